"""ZeRO-3's gradient norm with one multi-tensor kernel per dtype, on any number of ranks.

DeepSpeed 0.19.8's stage 3 (``get_grad_norm_direct``) takes the norm of each gradient partition with its own fp64 kernel
and two casts (llama-3.2-1b: 147 tensors, 3.3 ms of GPU time and ~1.7 ms of host launches a step, measured in its
two-rank code path on one H200), then stacks them, all-reduces the sum of squares over the partition group and takes the
root. ``foreach_norm`` computes the same fp64-accumulated L2 norm with ``torch._foreach_norm``, all-reduces the same sum
of squares over the same group (skipped on one rank), and returns DeepSpeed's -1 for a non-finite norm.

Installed on one engine's optimizer (``apply``) where DeepSpeed's own path would do only that: no optimizer offload
(offload takes its norm on the host path), no Muon, no model-parallel or expert-parallel group (whose norms DeepSpeed
counts differently). Any other shape leaves DeepSpeed's path and logs one line; so does a DeepSpeed outside the
versions it was tested on (compat.PATCHES). tests/test_zero3_norm.py checks the norm against DeepSpeed's formula;
tests/test_zero3_one_rank.py one rank against DeepSpeed's own norm; the two- and three-rank zero3 runs of
tests/test_train_e2e.py that gradient norms and losses are dp's.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import applied, enabled, needs

NAME = "foreach_norm"
_MARK = "_shardlab_foreach_norm"


def foreach_norm(opt) -> None:
    """Replace ``opt._get_norm_groups`` (DeepSpeed's stage-3 optimizer) with the multi-tensor norm."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.utils import get_norm_dtype

    needs(opt, "fp16_groups", "averaged_gradients", "_get_norm_groups", "_get_param_partition_group")
    for attr in ("offload_optimizer", "use_muon", "model_parallel_group"):
        if getattr(opt, attr, None):
            raise ValueError(f"the optimizer has {attr} set, where DeepSpeed counts the norm another way")
    dtype = get_norm_dtype()
    # each sub-group's partition group (None is DeepSpeed's whole world) and whether it has more than one rank, whose
    # squares are then added up: fixed for the engine's life, so found once here rather than every step
    groups = [opt._get_param_partition_group(params[0]) if params else None for params in opt.fp16_groups]
    summed = [bool(params) and dist.get_world_size(g) > 1 for g, params in zip(groups, opt.fp16_groups)]

    def norm_groups() -> list[torch.Tensor]:
        out = []
        for i, group in enumerate(groups):
            grads = list(opt.averaged_gradients[i])
            norms = torch._foreach_norm(grads, 2.0, dtype=dtype) if grads else [torch.zeros((), dtype=dtype)]
            squares = torch.stack(norms).square().sum()
            if summed[i]:
                dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
            total = squares.sqrt().float()
            out.append(torch.where(total.isfinite(), total, torch.full_like(total, -1.0)))
        return out

    opt._get_norm_groups = norm_groups


def apply(engine, log: Callable[[str], None] = print) -> bool:
    """Install ``foreach_norm`` on a ZeRO-3 engine's optimizer; whether it was."""
    opt = engine.optimizer
    if getattr(opt, _MARK, False):
        return True
    if not enabled(NAME):  # another DeepSpeed than the one it was tested on, or switched off
        return False
    try:
        foreach_norm(opt)
    except Exception as err:  # noqa: BLE001 - another DeepSpeed's internals: run without it, say so once
        log(f"ZeRO-3 shortcut {NAME} not applied ({type(err).__name__}: {err}): DeepSpeed's own path runs")
        return False
    setattr(opt, _MARK, True)
    applied(NAME)
    return True
