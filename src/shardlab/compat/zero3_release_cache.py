"""ZeRO-3: forget DeepSpeed's cached release decisions when its coordinator records a new trace.

DeepSpeed (0.19.8, deepspeed/runtime/zero/partitioned_param_coordinator.py) decides which parameters a module's
forward/backward releases in ``PartitionedParameterCoordinator.__params_to_release(submodule, step_id)``: the module's
own parameters minus those used again within ``stage3_max_reuse_distance`` of that step *in the recorded trace*. The
method is ``@functools.lru_cache(maxsize=None)``'d on (coordinator, submodule, step_id) and the cache is never cleared:
not by ``_clear_trace_structures``, ``_invalidate_trace``, nor when ``reset_step`` freezes a newly recorded trace. So
the answers computed against the first complete trace are kept for every later one. With shardlab's ``eval_at_start``
the first trace is the eval's forward-only one; training micro-batch 1 runs its forward on it, and its release
decisions hold for the whole run: bloom-3b on 1 GPU released the tied embedding/lm_head at the end of forward and
gathered it again after the loss' backward (10.21 GiB measured against 11.41 without the eval, and more all-gather
traffic). Any trace change can go wrong the other way too (parameters kept that the new trace would release).
benchmarks/diag/z3off/eval_first_probe.py shows it on CPU.

The fix: clear that cache whenever ``reset_step`` completes a newly recorded trace (RECORD -> COMPLETE). The
lru_cache lives on the class, so ``cache_clear`` drops every coordinator's entries, not only this one's: harmless (one
engine per process here; another engine recomputes its answers once, on its next use). Installed on the class, so
for the whole process: undone when the run ends (compat.restore_all).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from . import applied, enabled

_MARK = "_shardlab_clears_release_cache"  # set on the installed reset_step: applying twice does nothing more


def _cached_params_to_release(ppc: type) -> Any | None:
    """The lru_cache'd function under ``PartitionedParameterCoordinator.__params_to_release`` (name-mangled). It sits
    under ``@instrument_w_nvtx``, whose wrapper has no ``functools.wraps``: the cached function is in its closure."""
    f = getattr(ppc, "_PartitionedParameterCoordinator__params_to_release", None)
    for _ in range(4):  # a few decorator layers at most
        if f is None or callable(getattr(f, "cache_clear", None)):
            return f
        cells = getattr(f, "__closure__", None) or ()
        f = next((c.cell_contents for c in cells if callable(c.cell_contents)), None)
    return None


def apply_release_cache_fix(log: Callable[[str], None] = print) -> bool:
    """Install the fix once (idempotent); True when it is in place. With another DeepSpeed whose coordinator has not
    this shape, or outside the versions it was tested on, it changes nothing and logs one line: a missing fix costs
    memory or traffic, never the run."""
    if not enabled("zero3_release_cache"):
        return False
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

        if getattr(PPC.reset_step, _MARK, False):
            applied("zero3_release_cache")
            return True
        cached = _cached_params_to_release(PPC)
        needed = ("reset_step", "is_record_trace", "is_complete_trace")
        if cached is None or not all(callable(getattr(PPC, n, None)) for n in needed):
            raise AttributeError("no lru_cache'd __params_to_release, or no reset_step/is_record_trace/is_complete_trace")
        original = PPC.reset_step
        own = PPC.__dict__["reset_step"]  # what the class holds, decorators and all: what undo puts back

        @functools.wraps(original)
        def reset_step(self) -> None:
            recording = self.is_record_trace()
            original(self)
            if recording and self.is_complete_trace():  # a new trace: the cached release sets were the old trace's
                cached.cache_clear()

        try:  # as DeepSpeed's own reset_step (compiler.lazy_disable): the forward pre-hook may run under torch.compile
            from deepspeed.runtime.compiler import lazy_disable

            installed = lazy_disable(reset_step)
        except Exception:  # noqa: BLE001 - an older DeepSpeed without it: the plain wrapper
            installed = reset_step
        setattr(reset_step, _MARK, True)
        setattr(installed, _MARK, True)
        PPC.reset_step = installed

        def undo() -> None:
            PPC.reset_step = own

        applied("zero3_release_cache", undo)
        return True
    except Exception as err:  # noqa: BLE001 - another DeepSpeed's internals: run without the fix, say so once
        log(f"ZeRO-3 release-cache fix not applied ({type(err).__name__}: {err}): this DeepSpeed may reuse the first "
            "trace's release decisions (e.g. the initial eval's) for the whole run")
        return False
