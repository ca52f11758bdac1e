"""Bytecode for the training processes' imports, where this Python would not keep it.

A training process imports torch, transformers (and DeepSpeed): thousands of modules. Python keeps their compiled
bytecode in ``__pycache__`` beside the sources, unless it is told not to (``PYTHONDONTWRITEBYTECODE``, which
container images often set) or cannot write there (read-only site-packages: Apptainer/Singularity images, shared
software modules). Then every process compiles them from source again: on the H100 image (PYTHONDONTWRITEBYTECODE=1),
4,709 modules and 7.3 s per process, and gpt2-medium dp took 19.0-24.0 s to its first step against 10.0-12.6 s with
the bytecode kept (benchmarks/results/*-h100-startup/). When torch's and transformers' bytecode is missing
beside their sources (``PROBES``), the processes shardlab starts keep theirs in its own cache instead
(``PYTHONPYCACHEPREFIX``: nothing is written beside the sources). Where pip compiled them at install time nothing
changes. A prefix the user set is kept; ``SHARDLAB_BYTECODE_CACHE=0`` turns this off."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path

from ..cachedir import cache_root

OPT_OUT = "SHARDLAB_BYTECODE_CACHE"
# Modules of the packages whose imports are most of a worker's start-up: whether their bytecode sits beside them
# decides whether Python is keeping it there.
PROBES = (("torch", "_tensor.py"), ("torch", "_inductor/compile_fx.py"), ("transformers", "modeling_utils.py"),
          ("transformers", "models/auto/modeling_auto.py"))


def _bytecode_missing() -> bool:
    """Whether a probe module has no bytecode beside its source: Python is not writing it (PYTHONDONTWRITEBYTECODE,
    a read-only site-packages), or has not yet. Where pip compiled it at install time it is there, and a prefix would
    only make every fresh cache compile it all again (Python then reads bytecode from the prefix alone)."""
    for package, rel in PROBES:
        spec = importlib.util.find_spec(package)  # locates the package without importing it
        if spec is None or not spec.origin:
            continue
        source = Path(spec.origin).parent / rel
        if source.is_file() and not Path(importlib.util.cache_from_source(str(source))).is_file():
            return True
    return False


def bytecode_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to a training process's environment (empty: the bytecode is there, or the user decided)."""
    if environ.get(OPT_OUT) == "0" or environ.get("PYTHONPYCACHEPREFIX") or not _bytecode_missing():
        return {}
    # PYTHONDONTWRITEBYTECODE emptied for these processes only: with the prefix nothing lands beside the sources.
    return {"PYTHONPYCACHEPREFIX": str(cache_root() / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
