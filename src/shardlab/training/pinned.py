"""Cached pinned host memory that an engine's set-up leaves behind, given back to the OS.

torch's pinned-memory allocator (CachingHostAllocator) rounds every block up to a power of two and keeps freed blocks
cached for reuse; it never returns them by itself. DeepSpeed's ``zero.Init`` with parameter offload and pinning pins
each parameter's partition on its own (partition_parameters.py ``_partition_param``), then ZeRO-3's optimizer copies them
into one flat pinned buffer per group and frees them (stage3.py ``_create_fp16_partitions_with_defragmentation``): the
freed blocks stay cached, never reused (their sizes are those of single parameters), and held resident: bloom-7b1
zero3_offload measured 166.6 GiB against the 149.9 planned, 2 B/param of it those partitions
(benchmarks/results/*-h100x2-ds-offload). Releasing the cache once the engine is built returns that memory
before the first optimizer step adds CPU Adam's m and v.
"""

from __future__ import annotations

import torch

GIB = 2**30


def _cached_bytes() -> int | None:
    """Bytes the pinned allocator holds (in use + cached), or None where torch does not say."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    value = stats.get("allocated_bytes.current")
    return int(value) if value is not None else None


def release_cached(device_type: str) -> float:
    """Free the pinned blocks no tensor uses; returns the GiB given back (0.0 on a CPU run, or where this torch has no
    way to empty the host cache)."""
    if device_type != "cuda":
        return 0.0
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch >= 2.10
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)  # older torch: the same call, private
    if empty is None:
        return 0.0
    before = _cached_bytes()
    empty()
    after = _cached_bytes()
    return (before - after) / GIB if before is not None and after is not None else 0.0


def autotuned_in_first_step(optimizer: str) -> bool:
    """Whether a run's first step may leave pinned copies behind worth giving back: inductor's first-run autotuning of
    torchao's compiled 8-bit step copies the tensors it mutates (the weight and its moments) to pinned host memory where
    GPU clones would raise the peak (torch/_inductor/runtime/triton_heuristics.py ``copy_args_to_cpu_if_needed``):
    "released 8.0 GiB" at bloom-7b1 (benchmarks/results/*-h100-big-model, call 4). shardlab now autotunes that
    step before training with the clones on the GPU (loop/warm_8bit.py), so this finds nothing unless the warm-up
    could not run; summary.json's pinned_released_gib shows which. Not for every run: FSDP2's CPU offload copies each
    step's gradients into pinned blocks it frees and reuses, and emptying the cache after its first step made bloom-7b1's
    second step pin 28.4 GiB again (23.6 s against 13.2, call 5)."""
    return optimizer == "adamw8bit"
