"""Where shardlab keeps what it can rebuild (tokenized data, compiled graphs, the workers' bytecode): one owner of
the path, importable without torch (the supervising process and the CLI's checks read it too)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """shardlab's cache directory: $SHARDLAB_CACHE, else ~/.cache/shardlab."""
    root = os.environ.get("SHARDLAB_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "shardlab"


def built_once(out: Path, build: Callable[[Path], None]) -> Path:
    """The directory ``out``, built by ``build(tmp)`` into a temporary directory beside it and renamed into place, by
    one process at a time. The ranks of a run start together and each needs the same cached part: without the lock
    every one of them built it (a GGUF's dequantised weights: ~16 s of 2 CPU cores and a fp32 model in memory per
    process), and all but the first threw theirs away. A process that waited finds ``out`` built and returns it.
    The lock is an flock on ``.<name>.lock`` beside ``out``: the kernel drops it when its holder dies (kill -9 too),
    so no stale lock is ever left behind; the rename keeps a reader from seeing half a directory either way."""
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_dir():  # built while this process waited
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            build(tmp)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
