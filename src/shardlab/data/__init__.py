"""Training data: a DatasetConfig and a tokenizer in, fixed-length token blocks out.

    source rows (sources.py, hub.py) -> train/eval split (splits.py)
      -> text + token ids (formats.py) -> packed or padded blocks (blocks.py)
      -> on-disk cache (cache.py)

``build_datasets`` is the one entry point; its stats say what the data cost (padding,
dropped tails) and whether the cache was used.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import DatasetConfig
from ..errors import UserError
from . import cache
from .blocks import BlockDataset, Blocks, blocks_from_tokens, pack, pad, select_blocks
from .cache import default_cache_dir
from .formats import render, tokenize
from .sources import Source, classify, fingerprint, load_rows
from .splits import held_out_indices, select_splits

__all__ = ["TokenizedSplits", "BlockDataset", "build_datasets", "default_cache_dir"]

log = logging.getLogger(__name__)


@dataclass
class TokenizedSplits:
    train: torch.utils.data.Dataset
    eval: torch.utils.data.Dataset | None
    stats: dict[str, Any]


def build_datasets(
    ds: DatasetConfig,
    tokenizer: Any,
    seq_len: int,
    seed: int,
    cache_dir: str | Path | None = None,
    model_vocab: int | None = None,
    token_vocab: int | None = None,
) -> TokenizedSplits:
    """Tokenized train (and eval) blocks of exactly ``seq_len`` tokens, from the cache when possible.

    ``model_vocab``: the model's embedding rows. A tokenizer with more tokens than that (a random-init preset whose
    own tokenizer is not shipped, e.g. llama-2-13b's 32,000 rows with SmolLM2's 49,152-token tokenizer) would index
    past the embedding on text: refused here in one line; synthetic ids are drawn below it instead.

    ``tokenizer`` None: synthetic data with no tokenizer at all (training/tokenizing.run_tokenizer), its ids drawn below
    ``token_vocab`` (the size the tokenizer would have had, so the ids are those of a run that has it)."""
    if seq_len <= 0:
        raise UserError(f"seq_len must be positive, got {seq_len}", "set seq_len to e.g. 128")
    src = classify(ds)
    _check_format(ds, src)
    if tokenizer is None and (src.kind != "synthetic" or token_vocab is None):
        raise ValueError("build_datasets without a tokenizer is for synthetic data, with token_vocab")  # a caller's bug
    vocab = len(tokenizer) if tokenizer is not None else token_vocab
    if model_vocab is not None and vocab > model_vocab:
        if src.kind != "synthetic":
            raise UserError(f"the tokenizer has {vocab:,} tokens but the model embeds only {model_vocab:,}: its ids would "
                            "index past the embedding", "pass --tokenizer with the model's own tokenizer (a hub id or local "
                            "directory), or use --dataset synthetic")
        vocab = model_vocab
    key_parts = {
        "source": fingerprint(src),
        "dataset": ds.model_dump(mode="json", exclude={"source"}),  # every field that shapes the blocks
        "seq_len": seq_len,
        "seed": seed,
        "tokenizer": cache.tokenizer_identity(tokenizer) if tokenizer is not None else None,
    }
    if tokenizer is None or vocab != len(tokenizer):  # (only then: the keys of existing caches stay as they were)
        key_parts["vocab"] = vocab
    key = cache.cache_key(key_parts)
    path = cache.cache_path(Path(cache_dir) if cache_dir is not None else default_cache_dir(), key, _label(src, ds, seq_len))

    cached = cache.load(path)
    if cached is not None:
        train, evals, stats = cached
        log.info("data: cache hit %s", path)
        return _splits(train, evals, {**stats, "cache_path": str(path), "cache_hit": True})

    started = time.perf_counter()
    if src.kind == "synthetic":
        train, evals, stats = _build_synthetic(ds, vocab, seq_len, seed)
    else:
        train, evals, stats = _build_from_rows(src, ds, tokenizer, seq_len, seed)
    stats["build_seconds"] = round(time.perf_counter() - started, 3)
    stats["cache_path"] = str(path)
    stats["cache_hit"] = False
    cache.save(path, train, evals, stats)
    log.info("data: built %s in %.1fs (%d train blocks)", stats["source"], stats["build_seconds"], len(train))
    return _splits(train, evals, stats)


def _check_format(ds: DatasetConfig, src: Source) -> None:
    if ds.format == "qa" and src.kind in ("offline", "synthetic"):
        raise UserError(
            f"the {src.kind!r} source has no questions and answers, so --format qa cannot use it",
            "use --format lm, or a QA source such as squad or a file with question/context/answer columns",
        )
    if ds.answer_only_loss and ds.format != "qa":
        raise UserError("answer_only_loss needs the qa format", "add --format qa or drop answer_only_loss")


def _label(src: Source, ds: DatasetConfig, seq_len: int) -> str:
    name = src.path.name if src.path is not None else src.name
    return f"{name}-{ds.format}-{ds.packing}-L{seq_len}"


def _pad_id(tokenizer: Any) -> int:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise UserError("tokenizer has neither a pad nor an eos token", "use a causal-LM tokenizer")
    return int(pad_id)


def _build_from_rows(
    src: Source, ds: DatasetConfig, tokenizer: Any, seq_len: int, seed: int
) -> tuple[Blocks, Blocks | None, dict[str, Any]]:
    raw = load_rows(src, ds)
    train_rows, eval_rows, duplicates = select_splits(raw, ds, seed)
    # num_samples / eval_samples count usable examples, after blank rows are skipped
    train_text = render(train_rows, ds, raw.description).head(ds.num_samples)
    eval_text = render(eval_rows, ds, raw.description).head(ds.eval_samples) if eval_rows is not None else None
    misplaced = train_text.misplaced + (eval_text.misplaced if eval_text else 0)
    if not train_text.texts:
        if train_text.misplaced:
            raise UserError(
                f"no usable training examples in {raw.description}: {misplaced} QA example(s) have no answer at "
                "their answer_start in the context (outside it, or other text there)",
                "fix answer_start (a character offset into the context) or the answer text, or drop answer_start",
            )
        raise UserError(
            f"no usable training examples in {raw.description}",
            "check that the data holds non-empty text (or question/context/answer rows for --format qa)",
        )
    make = pack if ds.packing == "pack" else pad
    pad_id = _pad_id(tokenizer)
    only = ds.answer_only_loss
    train = make(tokenize(train_text, tokenizer, answer_only=only), seq_len, pad_id)
    evals = make(tokenize(eval_text, tokenizer, answer_only=only), seq_len, pad_id) if eval_text is not None and eval_text.texts else None
    if len(train) == 0:
        raise UserError(
            f"no training block has a token to learn from in {raw.description}",
            "raise seq_len so that answers fit, or drop answer_only_loss",
        )
    stats = _stats(raw.description, ds, seq_len, train, evals, len(train_text.texts), len(eval_text.texts) if eval_text else 0)
    stats["skipped_rows"] = train_text.skipped + (eval_text.skipped if eval_text else 0)
    stats["misplaced_answers"] = misplaced  # among skipped_rows
    stats["duplicates_dropped"] = {"exact": duplicates.exact, "near": duplicates.near}  # before the held-out split
    return train, evals if evals is not None and len(evals) else None, stats


def _build_synthetic(
    ds: DatasetConfig, vocab: int, seq_len: int, seed: int
) -> tuple[Blocks, Blocks | None, dict[str, Any]]:
    """Uniform random ids in [0, vocab): a throughput workload with a known loss floor (ln V)."""
    if ds.synthetic_tokens < seq_len:
        raise UserError(
            f"synthetic_tokens {ds.synthetic_tokens} is fewer than seq_len {seq_len}",
            "raise dataset.synthetic_tokens or lower seq_len",
        )
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (ds.synthetic_tokens,), generator=gen, dtype=torch.int64)
    blocks = blocks_from_tokens(tokens, seq_len)
    train_idx, eval_idx = held_out_indices(len(blocks), ds.eval_split, seed)
    train_idx = train_idx[: ds.num_samples] if ds.num_samples else train_idx
    eval_idx = eval_idx[: ds.eval_samples] if ds.eval_samples else eval_idx
    train = select_blocks(blocks, train_idx)
    evals = select_blocks(blocks, eval_idx) if eval_idx else None
    desc = f"synthetic: {ds.synthetic_tokens} uniform random tokens (vocab {vocab}, seed {seed})"
    stats = _stats(desc, ds, seq_len, train, evals, len(train), len(evals) if evals is not None else 0)
    stats["dropped_tail_tokens"] = blocks.dropped_tail_tokens
    return train, evals, stats


def _stats(
    desc: str, ds: DatasetConfig, seq_len: int, train: Blocks, evals: Blocks | None, n_train: int, n_eval: int
) -> dict[str, Any]:
    train_tokens = len(train) * seq_len
    useful = train.useful_tokens()
    return {
        "source": desc,
        "format": ds.format,
        "packing": ds.packing,
        "seq_len": seq_len,
        "train_examples": n_train,
        "eval_examples": n_eval if evals is not None else 0,
        "train_blocks": len(train),
        "eval_blocks": len(evals) if evals is not None else 0,
        "train_tokens": train_tokens,
        "train_useful_tokens": useful,
        "train_loss_tokens": train.loss_tokens(),
        "non_pad_fraction": round(useful / train_tokens, 6) if train_tokens else 0.0,
        "eval_tokens": len(evals) * seq_len if evals is not None else 0,
        "truncated_examples": train.truncated + (evals.truncated if evals is not None else 0),
        "dropped_blocks_without_loss": train.dropped + (evals.dropped if evals is not None else 0),
        "dropped_tail_tokens": train.dropped_tail_tokens,
    }


def _splits(train: Blocks, evals: Blocks | None, stats: dict[str, Any]) -> TokenizedSplits:
    return TokenizedSplits(BlockDataset(train), BlockDataset(evals) if evals is not None else None, stats)
