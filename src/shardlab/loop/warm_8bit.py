"""torchao's compiled 8-bit AdamW step, compiled and autotuned before the first step, on scratch tensors.

torchao compiles its step (``single_param_adam``) once per parameter shape. On a GPU, inductor then benchmarks each new
kernel's configurations on the real tensors at their first call, and a kernel that mutates its arguments (the weight,
each moment's 8-bit codes and block scales) works on copies: clones on the GPU where they fit under the peak so far
(``max_memory_allocated - memory_allocated``), otherwise pinned host copies (torch/_inductor/runtime/triton_heuristics.py,
``copy_args_to_cpu_if_needed``). In a first run that happened inside the first step, at whatever headroom that moment
had: bloom-7b1 pinned 7-8 GiB of host memory there, depending on the micro batch, which the plan could only bound
(+14.4% at micro 32; benchmarks/results/*-h100-remeasure).

Here every distinct (shape, dtype, hyper-parameters) is stepped once on scratch copies before training, with inductor's
clones kept on the GPU (compat/autotune.py): at set-up the GPU holds only the weights, so the clones fit, the host sees none of it, and the
graphs and the configurations chosen are those the real step then uses (dynamo's cache is keyed on exactly these
guards: ``tests/test_warm_8bit.py`` checks the real first step compiles nothing). The GPU moment this adds (weights,
then one shape's scratch weight, gradient, moments, their clones and the step's temporaries) is the planner's
``eight_bit_warmup_bytes``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..compat.autotune import clones_on_device
from ..config import RunConfig
from ..training import optim

GIB = 2**30


def _key(p: torch.Tensor, group: dict) -> tuple:
    """What dynamo's guards on torchao's compiled step see of a parameter and its group (a new key: a new graph)."""
    placements = tuple(getattr(p, "placements", ()))  # FSDP2's DTensor shards
    return (type(p), tuple(p.shape), p.stride(), p.dtype, p.device, placements,
            group["betas"], group["eps"], group["weight_decay"], group.get("amsgrad", False))


def distinct(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """One (parameter, its group) per distinct compiled graph of the step, largest first."""
    seen: dict[tuple, tuple[torch.Tensor, dict]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(_key(p, group), (p, group))
    return sorted(seen.values(), key=lambda pg: -pg[0].numel())


def warm(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> dict[str, Any]:
    """Compile and autotune the 8-bit step for each distinct parameter before training (on any device; the trainer
    calls it on GPUs, where the autotuner's copies are at stake). The real weights, moments and random state are
    untouched. Returns what summary.json records."""
    from ..planning.planner import eight_bit_warmup_bytes  # here: the trainer imports this module for every run

    cls = optim.torchao_optim().AdamW8bit
    pairs = distinct(optimizer)
    device = pairs[0][0].device if pairs else torch.device("cpu")
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    planned = max((eight_bit_warmup_bytes(_local(p).numel(), p.element_size()) for p, _ in pairs), default=0)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    peak_before = torch.cuda.max_memory_allocated(device) if cuda else 0
    with torch.random.fork_rng(devices=[device] if cuda else []), clones_on_device() as steered:
        for p, group in pairs:
            scratch = torch.nn.Parameter(p.detach().clone())  # real values: the quantiser sees realistic blocks
            scratch.grad = torch.full_like(scratch, 1e-3)
            opt = cls([scratch], lr=float(group["lr"]), betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], **optim.eight_bit_kwargs(cfg))
            opt.step()
            del opt, scratch
    if cuda:
        torch.cuda.synchronize(device)
    out: dict[str, Any] = {"graphs": len(pairs), "seconds": round(time.perf_counter() - t0, 2),
                           "clones_on_device": steered}
    if cuda:  # measured only where the warm-up set a new peak (an earlier moment of the set-up may have been higher)
        peak = torch.cuda.max_memory_allocated(device)
        out["gpu_peak_above_weights_gib"] = round((peak - before) / GIB, 3) if peak > peak_before else None
        out["planned_above_weights_gib"] = round(planned / GIB, 3)
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
