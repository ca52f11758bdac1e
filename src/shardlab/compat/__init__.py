"""Every patch shardlab makes to a dependency's private code, in one place, each with the versions it was tested on.

A patch replaces or wraps a function a dependency calls internally, sets an attribute its private code reads as a
hook, or rewrites files it wrote. Each is declared once in ``PATCHES`` below: the modules of this package apply them,
and only after ``enabled(name)`` said yes. Outside the versions a patch was tested on (``Patch.tested``: the CPU
image's and the GPU image's) a dependency's private code may have another shape, and a patch that still applies
could compute something else without failing: there it is off, said in one line, and the dependency's own path runs.

The switch, one for all of them: ``SHARDLAB_PATCHES``, a comma-separated list: ``-NAME`` turns a patch off,
``+NAME`` turns it on outside its tested versions (at your risk: try a newer DeepSpeed), ``-all`` turns every patch
off. An environment variable, not a config key: several patches apply deep in code that is handed no run config (the
hub loader, the universal-checkpoint conversion, the GGUF loader), and every process of a run inherits it (spawned
workers, torchrun and srun ranks, ``shardlab plan``).

What a run applied goes into summary.json (``patches``; those considered and left off, with why, in
``patches_off``). A patch made on a class or module (process-wide) registers how to undo it; the worker undoes them
all when its run ends (``restore_all``), so a second ``shardlab.train()`` in one process starts from the
dependencies' own code. Patches of one object (an engine's optimizer, a model's modules) end with that object.

Not counted as patches: setting an attribute a dependency reads as configuration (DeepSpeed's
``load_universal_checkpoint``, inductor's ``compile_threads``, transformers' ``_is_hf_initialized`` and
``is_custom_code`` while it initialises), subclassing a model's own module (the padded or skippable output head), and
calling a private function without replacing it.

This module imports no torch: the launcher and the CLI check the switch before anything heavy loads.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .. import messages
from ..errors import UserError

SWITCH_ENV = "SHARDLAB_PATCHES"
# The patches already reported off by the launching process: its workers do not say it a second time.
_SAID_ENV = "SHARDLAB_PATCHES_SAID"

# The versions the images hold: CPU torch 2.13.0, transformers 5.24.0; GPU torch 2.11.0+cu130, transformers 5.17.0;
# both DeepSpeed 0.19.8, datasets 5.2.0, CPython 3.11 (CPU) and 3.12 (GPU). pyproject.toml admits the same ranges.
TORCH = ("torch", ">=2.11,<2.14")
TRANSFORMERS = ("transformers", ">=5.17,<5.25")
DEEPSPEED = ("deepspeed", "==0.19.8")
DATASETS = ("datasets", ">=5.2,<5.3")
CPYTHON = ("python", ">=3.11,<3.13")


@dataclass(frozen=True)
class Patch:
    name: str
    module: str  # the module of this package that applies it
    target: str  # what of the dependency it changes
    scope: str  # "object": one object, gone with it; "process": a class or module, undone when the run ends; "call":
    # undone when the call that needed it returns; "files": files the dependency wrote
    off: str  # what runs instead when it is off
    tested: tuple[tuple[str, str], ...]  # (distribution, the versions it was tested on)


PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch("keep_gathered", "zero3_one_rank", "DeepSpeed ZeRO-3 optimizer's _partition_all_parameters and step",
          "object", "DeepSpeed releases and re-gathers every parameter each step", (DEEPSPEED,)),
    Patch("foreach_norm", "zero3_norm", "DeepSpeed ZeRO-3 optimizer's _get_norm_groups",
          "object", "DeepSpeed's per-tensor gradient norms", (DEEPSPEED,)),
    Patch("identity_reduce_scatter", "zero3_one_rank", "deepspeed.runtime.zero.stage3.reduce_scatter_coalesced",
          "process", "DeepSpeed's reduce-scatter, also over a one-rank group", (DEEPSPEED,)),
    Patch("zero3_release_cache", "zero3_release_cache", "DeepSpeed's PartitionedParameterCoordinator.reset_step",
          "process", "DeepSpeed keeps the first trace's release decisions for the whole run", (DEEPSPEED,)),
    Patch("universal_checkpoint", "universal_checkpoint", "the files DeepSpeed's ds_to_universal writes",
          "files", "DeepSpeed's universal checkpoint as it writes it (it loads into the stage that wrote it)",
          (DEEPSPEED,)),
    Patch("bloom_sdpa", "bloom_sdpa", "transformers' BloomAttention.forward (each instance)",
          "object", "transformers' eager BLOOM attention", (TRANSFORMERS,)),
    Patch("init_by_module", "module_init", "transformers' PreTrainedModel._initialize_weights (each instance)",
          "call", "FSDP on several ranks initialises each shard in place (other random numbers than dp's)",
          (TRANSFORMERS,)),
    Patch("gguf_quantizer", "gguf", "transformers' hf_quantizer of a dequantised GGUF model",
          "object", "transformers keeps the GGUF quantizer and refuses to save the model", (TRANSFORMERS,)),
    Patch("autotune_clones", "autotune", "inductor's CachingAutotuner.copy_args_to_cpu_if_needed",
          "call", "inductor copies mutated arguments to pinned host memory while it autotunes", (TORCH,)),
    Patch("fused_clip", "fused_clip", "torch's fused AdamW grad_scale hook",
          "call", "clip_grad_norm_ scales the gradients before the step", (TORCH,)),
    Patch("stage_timer", "stage_timer", "torch.distributed.pipelining stages' forward/backward_one_chunk",
          "object", "no per-stage forward/backward times in summary.json", (TORCH,)),
    Patch("thread_spawn", "thread_spawn", "threading.Thread.start, subprocess.Popen._execute_child, "
          "multiprocessing.util.spawnv_passfds, os.posix_spawn(p)", "process",
          "no training-thread pin (a thread or process created while pinned would keep the one CPU)", (CPYTHON,)),
    Patch("hub_offline", "hub_offline", "datasets.config and huggingface_hub.constants HF_HUB_OFFLINE",
          "call", "datasets and the hub client ask the network, and wait for its time-outs", (DATASETS,)),
)}


# ---- versions ------------------------------------------------------------------------------------


@functools.cache  # the planner asks for every strategy it plans; what is installed does not change in a process
def installed(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``python``: the interpreter's), None when it is not installed."""
    if distribution == "python":
        return ".".join(str(n) for n in sys.version_info[:3])
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_range(version: str, specifier: str) -> bool:
    """Whether ``version`` is within ``specifier``, by its release numbers: a local build (``+cu130``) or a release
    candidate of a tested release is that release; a nightly of the next one is not."""
    try:
        return SpecifierSet(specifier).contains(Version(version).base_version)
    except InvalidVersion:
        return False


# ---- the switch ----------------------------------------------------------------------------------


def _switch() -> tuple[set[str], set[str]]:
    """(names turned off, names turned on outside their tested versions) by SHARDLAB_PATCHES."""
    off, on = set(), set()
    for token in os.environ.get(SWITCH_ENV, "").replace(" ", ",").split(","):
        if token.startswith("-"):
            off.add(token[1:])
        elif token.startswith("+"):
            on.add(token[1:])
    return off, on


def check_switch() -> None:
    """SHARDLAB_PATCHES names only known patches, each with - or +: refused in one line before anything starts."""
    tokens = [t for t in os.environ.get(SWITCH_ENV, "").replace(" ", ",").split(",") if t]
    bad = [t for t in tokens if t[:1] not in "-+" or (t[1:] not in PATCHES and t != "-all")]
    if bad:
        raise UserError(f"{SWITCH_ENV}={os.environ[SWITCH_ENV]}: {', '.join(repr(t) for t in bad)} is not -NAME, +NAME "
                        "or -all of a known patch", f"names: {', '.join(PATCHES)}")


def why_off(name: str) -> str | None:
    """Why patch ``name`` does not apply here (switched off, a dependency outside its tested versions), or None."""
    patch = PATCHES[name]
    off, on = _switch()
    if name in off or ("all" in off and name not in on):
        return f"turned off by {SWITCH_ENV}"
    if name in on:
        return None
    for dist, spec in patch.tested:
        version = installed(dist)
        if version is None:
            return f"{dist} is not installed"
        if not in_range(version, spec):
            return f"{dist} {version} is outside the versions it was tested on ({spec}; {SWITCH_ENV}=+{name} turns it on)"
    return None


# ---- what this process applied -------------------------------------------------------------------


class _Record:
    applied: list[str] = []
    off: dict[str, str] = {}
    undo: dict[str, Callable[[], None]] = {}


def _say(line: str) -> None:
    messages.info(line)  # rank 0's only (messages' filter): every rank decides the same


def enabled(name: str) -> bool:
    """Whether patch ``name`` may apply here; when not, one line says why and what runs instead (once per run)."""
    why = why_off(name)
    if why is None:
        return True
    if name not in _Record.off:
        _Record.off[name] = why
        said = os.environ.get(_SAID_ENV, "").split(",")
        if name not in said:
            _say(f"patch {name} off: {why}; instead {PATCHES[name].off}")
            os.environ[_SAID_ENV] = ",".join([*filter(None, said), name])
    return False


def needs(opt, *names: str) -> None:
    """Raise AttributeError naming what of ``names`` a dependency's optimizer ``opt`` lacks: its private code has another
    shape than a patch was written for, and the patch must not go on."""
    missing = [n for n in names if not hasattr(opt, n)]
    if missing:
        raise AttributeError(f"the optimizer has no {', '.join(missing)}")


def applied(name: str, undo: Callable[[], None] | None = None) -> None:
    """Record that patch ``name`` is in place; ``undo`` (process-wide patches) puts the dependency's code back."""
    assert name in PATCHES, name
    if name not in _Record.applied:
        _Record.applied.append(name)
    if undo is not None:
        _Record.undo[name] = undo


def restore_all() -> None:
    """Undo every process-wide patch still in place, newest first (a worker calls it when its run ends)."""
    for name in reversed(list(_Record.undo)):
        _Record.undo.pop(name)()


def start_run() -> None:
    """Forget what an earlier run in this process applied (a notebook calling ``shardlab.train()`` twice)."""
    restore_all()
    _Record.applied, _Record.off = [], {}


def summary() -> dict[str, object]:
    """summary.json's ``patches`` (applied, in order) and ``patches_off`` (considered, not applied: why)."""
    return {"patches": list(_Record.applied), "patches_off": dict(_Record.off) or None}


__all__ = ["PATCHES", "Patch", "SWITCH_ENV", "applied", "check_switch", "enabled", "in_range", "installed",
           "restore_all", "start_run", "summary", "why_off"]
