"""Where shardlab keeps what it can rebuild (tokenized data, compiled graphs, the workers' bytecode): one owner of
the path, importable without torch (the supervising process and the CLI's checks read it too)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """shardlab's cache directory: $SHARDLAB_CACHE, else ~/.cache/shardlab."""
    root = os.environ.get("SHARDLAB_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "shardlab"
