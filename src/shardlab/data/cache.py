"""On-disk cache of tokenized blocks, keyed by everything that changes them.

One ``.pt`` file per key holding plain tensors and a JSON stats string, read back with
``torch.load(weights_only=True)`` (no pickled code). Writes go to a temp file in the same
directory and ``os.replace`` it into place, so ranks building the same data at once never
see a half-written file; the last writer wins with identical content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..cachedir import cache_root
from .blocks import Blocks

log = logging.getLogger(__name__)

# Bump when the way blocks are built changes, so stale caches are not reused.
# 2: qa without answer_only_loss has loss on every token (1 masked the prompt regardless); misplaced answers skipped.
# 3: duplicate rows dropped before a held-out split (splits.deduplicated).
# 4: a text file that is mostly not UTF-8 is refused (sources.MAX_UNREADABLE_SHARE), not tokenized.
CACHE_VERSION = 4
_PROBE_TEXT = "Hello world\nQuestion: Why?\nAnswer: 42"


def default_cache_dir() -> Path:
    return cache_root() / "data"


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """Name, sizes, special ids, a vocab digest and a probe encoding (catches BOS/EOS policies)."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        digest.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return {
        "class": type(tokenizer).__name__,
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "len": len(tokenizer),
        "vocab_sha256": digest.hexdigest(),
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "probe": list(tokenizer(_PROBE_TEXT, add_special_tokens=True)["input_ids"]),
    }


def cache_key(parts: dict[str, Any]) -> str:
    blob = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_path(cache_dir: Path, key: str, label: str) -> Path:
    # a readable prefix for people browsing the directory; the hash makes it unique
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")[-60:]
    return cache_dir / f"{slug}-{key[:24]}.pt"


def load(path: Path) -> tuple[Blocks, Blocks | None, dict[str, Any]] | None:
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("version") != CACHE_VERSION:
            return None
        train = Blocks.from_state(state["train"])
        evals = Blocks.from_state(state["eval"]) if state.get("eval") is not None else None
        return train, evals, json.loads(state["stats"])
    except Exception as exc:  # noqa: BLE001 - a damaged cache file is rebuilt, never fatal
        log.warning("ignoring unreadable data cache %s (%s); rebuilding", path, exc)
        return None


def save(path: Path, train: Blocks, evals: Blocks | None, stats: dict[str, Any]) -> bool:
    """Write atomically; a read-only or full disk only costs the cache, not the run."""
    state = {
        "version": CACHE_VERSION,
        "train": train.state(),
        "eval": evals.state() if evals is not None else None,
        "stats": json.dumps(stats),
    }
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("could not write data cache %s (%s); continuing without it", path, exc)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
