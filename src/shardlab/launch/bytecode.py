"""Bytecode for the training processes' imports, where this Python would not keep it.

A training process imports torch, transformers (and DeepSpeed): thousands of modules. Python keeps their compiled
bytecode in ``__pycache__`` beside the sources, unless it is told not to (``PYTHONDONTWRITEBYTECODE``, which
container images often set) or cannot write there (read-only site-packages: Apptainer/Singularity images, shared
software modules). Then every process compiles them from source again: on the H100 image (PYTHONDONTWRITEBYTECODE=1),
4,709 modules and 7.3 s per process, and gpt2-medium dp took 19.0-24.0 s to its first step against 10.0-12.6 s with
the bytecode kept (benchmarks/results/2026-11-26-h100-startup/). For the processes shardlab starts, the bytecode
then goes to its own cache (``PYTHONPYCACHEPREFIX``: nothing is written beside the sources). A prefix the user set
is kept; ``SHARDLAB_BYTECODE_CACHE=0`` turns this off."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from ..cachedir import cache_root

OPT_OUT = "SHARDLAB_BYTECODE_CACHE"
# The packages whose imports are most of a worker's start-up: their __pycache__ decides whether bytecode is kept.
HEAVY = ("torch", "transformers")


def _unwritable_pycache(package: str) -> bool:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.origin:
        return False
    pycache = Path(spec.origin).parent / "__pycache__"
    return not os.access(pycache if pycache.is_dir() else pycache.parent, os.W_OK)


def bytecode_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to a training process's environment (empty: Python keeps its bytecode already)."""
    if environ.get(OPT_OUT) == "0" or environ.get("PYTHONPYCACHEPREFIX"):
        return {}
    if not environ.get("PYTHONDONTWRITEBYTECODE") and not any(_unwritable_pycache(p) for p in HEAVY):
        return {}
    # PYTHONDONTWRITEBYTECODE emptied for these processes only: with the prefix nothing lands beside the sources.
    return {"PYTHONPYCACHEPREFIX": str(cache_root() / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
