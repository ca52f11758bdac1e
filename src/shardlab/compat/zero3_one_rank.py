"""ZeRO-3 on one rank: skip the step's work that only moves data between a rank and itself.

On one rank without offload every parameter persists (sized_buckets: persistence = the model's size), a parameter's
ZeRO-3 partition is the whole parameter, and DeepSpeed's "gather" makes ``param.data`` a view of that partition
(partition_parameters.NoGatherCoalescedHandle). What stage 3 still does there each step, in DeepSpeed 0.19.8
(deepspeed/runtime/zero/stage3.py), is host work the one GPU waits for (one-rank zero3 is host-bound):

1. ``step`` releases every parameter (``_partition_all_parameters``: per parameter a ``record_stream`` and a fresh empty
   tensor) and ``_post_step`` gathers them back; then ``NoGatherCoalescedHandle.wait`` synchronises the device, so the
   next step's first kernels start from an idle GPU. The optimizer wrote the new weights into the flat 16-bit buffer
   the partitions (and so the parameters) are views of: the release and the gather change nothing. ``keep_gathered``
   skips them while every parameter persists, is available, has no active module and is that view.
2. the end-of-backward reduce: ``reduce_scatter_coalesced`` over a one-rank group copies every gradient into one flat
   buffer and reduce-scatters it to the same rank (the identity). ``identity_reduce_scatter`` returns the gradients
   themselves, flattened, where the group has one rank; DeepSpeed then copies them into its gradient partitions as
   before.
The gradient norm's per-tensor kernels, which one rank shared with several, are compat/zero3_norm.py's (any number of
ranks).

Each is installed on one engine (``apply``), or, for the reduce-scatter, on stage 3's module name for one-rank groups
only (undone when the run ends: compat.restore_all); anything else in this DeepSpeed's shape leaves the engine as it
was and logs one line, and so does a DeepSpeed outside the versions they were tested on (compat.PATCHES). What each
saves is measured in benchmarks/results/*-h100-zero3-one-rank/; tests/test_zero3_one_rank.py checks that losses and
gradient norms are the same with and without them on the CPU.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from . import applied, enabled, needs
from ..config import ZERO3_ONE_RANK_SHORTCUTS as SHORTCUTS  # the names a config gives them, in this order

_MARK = "_shardlab_one_rank"


def _params(opt) -> list:
    return [p for group in opt.fp16_groups for p in group]


def _is_view_of_partition(p) -> bool:
    t = getattr(p, "ds_tensor", None)
    return t is not None and t.numel() == p.numel() and p.data.data_ptr() == t.data.data_ptr()


def keep_gathered(opt) -> None:
    """Step without releasing and re-gathering parameters that are views of their partitions (1. above)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    needs(opt, "fp16_groups", "_partition_all_parameters", "step")
    params = _params(opt)
    original = opt._partition_all_parameters
    step = opt.step
    in_step = [False]

    def all_kept() -> bool:
        return all(p.ds_persist and p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_active_sub_modules
                   and _is_view_of_partition(p) for p in params)

    def partition_all_parameters() -> None:
        if in_step[0] and all_kept():
            opt.shardlab_kept_gathered += 1
            return
        original()  # a checkpoint load or save, or a parameter not (yet) a view: DeepSpeed's own

    @functools.wraps(step)
    def stepped(*args: Any, **kwargs: Any):
        in_step[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            in_step[0] = False

    opt.shardlab_kept_gathered = 0
    opt._partition_all_parameters = partition_all_parameters
    opt.step = stepped


def identity_reduce_scatter() -> None:
    """Stage 3's reduce_scatter_coalesced returns the inputs, flattened, for a one-rank group (2. above). Installed on
    the name stage3.py calls, once per process; groups of more ranks go to DeepSpeed's own."""
    from deepspeed.runtime.zero import stage3

    original = stage3.reduce_scatter_coalesced
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def reduce_scatter_coalesced(tensors, group=None):
        import deepspeed.comm as dist

        if dist.get_world_size(group) == 1:
            return [t.reshape(-1) for t in tensors]
        return original(tensors, group)

    setattr(reduce_scatter_coalesced, _MARK, True)
    stage3.reduce_scatter_coalesced = reduce_scatter_coalesced

    def undo() -> None:
        stage3.reduce_scatter_coalesced = original

    applied("identity_reduce_scatter", undo)


def apply(engine, shortcuts: tuple[str, ...] = SHORTCUTS, log: Callable[[str], None] = print) -> list[str]:
    """Install ``shortcuts`` on a one-rank ZeRO-3 engine without offload; the names installed. The caller decides that
    the run is one (deepspeed_config.one_rank_zero3)."""
    opt = engine.optimizer
    done: list[str] = []
    if getattr(opt, _MARK, None) is not None:
        return list(getattr(opt, _MARK))
    for name in shortcuts:
        if not enabled(name):  # another DeepSpeed than the one they were tested on, or switched off
            continue
        try:
            if name == "keep_gathered":
                keep_gathered(opt)
            elif name == "identity_reduce_scatter":
                identity_reduce_scatter()
            else:
                raise ValueError(f"unknown shortcut {name!r}")
            done.append(name)
            applied(name)
        except Exception as err:  # noqa: BLE001 - another DeepSpeed's internals: run without it, say so once
            log(f"one-rank ZeRO-3 shortcut {name} not applied ({type(err).__name__}: {err}): DeepSpeed's own path runs")
    setattr(opt, _MARK, tuple(done))
    return done
