"""Per-device ordered action lists for each pipeline schedule.

A schedule is only an *order*: which forward/backward each device runs next. Timing is the
simulator's job (simulator.py), so the same order can be replayed with any stage costs.

Stages are numbered like torch.distributed.pipelining: with P devices and V chunks per device
there are P*V (virtual) stages, stage s lives on device s % P as chunk s // P (the "loop"
placement of Interleaved 1F1B), except under ZBV, whose 2 stages per device form a V: device d
holds stages d (chunk 0, on the way down) and 2P-1-d (chunk 1, on the way back), so the first
and the last stage share device 0 (torch's generate_stage_to_rank_mapping(style="v")).
Micro-batch numbers are 0-based, as in torch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zbv", "pipedream", "pipedream-2bw")
# Schedules that flush the pipeline (all backwards done) before every weight update.
SYNCHRONOUS = ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zbv")
# Schedules that split each backward into I (input gradient, on the critical path) and W (weight gradient, deferrable).
SPLIT_BACKWARD = ("zbv",)
# Schedules with a fixed number of stages per device (V), whatever --chunks says.
FIXED_CHUNKS = {"zbv": 2}
# How a schedule places its virtual stages on devices: "loop" (s % P) unless named here.
PLACEMENT = {"zbv": "v"}


class Action(NamedTuple):
    kind: str  # "F", "B" (full backward: input and weight gradients together), "I" (input gradient), "W" (weight gradient)
    microbatch: int
    stage: int  # virtual stage index; its device: stage_device(schedule, stage, P); chunk = stage // P


def place(stage: int, n_devices: int, placement: str = "loop") -> int:
    """The device (pipeline rank) that runs virtual stage ``stage``: "loop" (s % P), or "v" (ZBV's V: s for the
    first P stages, 2P-1-s for the next P). One owner: the simulator, the planner and the pipeline strategy
    (through layout.ParallelLayout) all place stages here."""
    if placement == "v":
        return stage if stage < n_devices else 2 * n_devices - 1 - stage
    if placement != "loop":
        raise ValueError(f"unknown stage placement {placement!r}")
    return stage % n_devices


def stage_device(schedule: str, stage: int, n_devices: int) -> int:
    """The device that runs virtual stage ``stage`` under ``schedule`` (``place`` with the schedule's placement)."""
    return place(stage, n_devices, PLACEMENT.get(schedule, "loop"))


def device_stages(schedule: str, device: int, n_devices: int, n_chunks: int) -> list[int]:
    """The virtual stages on ``device``, ascending (chunk 0 first)."""
    return [s for s in range(n_devices * n_chunks) if stage_device(schedule, s, n_devices) == device]


def gpipe_order(device: int, n_mb: int) -> list[Action]:
    """All forwards, then all backwards in the same micro-batch order.

    Mirrors torch ScheduleGPipe._step_microbatches (the `for i in range(n_microbatches)`
    forward loop, then the identical backward loop), which is also ScheduleGPipe._get_pipeline_order.
    """
    return [Action("F", m, device) for m in range(n_mb)] + [Action("B", m, device) for m in range(n_mb)]


def one_f_one_b_order(device: int, n_stages: int, n_mb: int) -> list[Action]:
    """Warm-up forwards, then alternate one backward / one forward, then drain the backwards.

    Mirrors torch Schedule1F1B._step_microbatches: `warmup_chunks = min(n_microbatches,
    num_stages - stage_index)` forwards, the `while True` "1B1F" loop (backward first, break
    once every forward is issued) and the cooldown `while bwd_mb_index < n_microbatches`.
    (Schedule1F1B._get_pipeline_order in torch 2.13 is *not* used: for the last rank it starts
    at F1 and ends at F{M}, an off-by-one in that IR; the executed loop above is F0, B0, F1, ...)
    """
    warmup = min(n_mb, n_stages - device)
    order = [Action("F", m, device) for m in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        order.append(Action("B", bwd, device))
        bwd += 1
        if fwd == n_mb:
            break
        order.append(Action("F", fwd, device))
        fwd += 1
    order += [Action("B", m, device) for m in range(bwd, n_mb)]
    return order


def interleaved_order(device: int, n_devices: int, n_chunks: int, n_mb: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM, depth first), the order torch builds for ScheduleInterleaved1F1B.

    Mirrors ScheduleInterleaved1F1B._calculate_single_rank_operations + _get_warmup_ops +
    _get_1f1b_rank_ops (enable_zero_bubble=False) with the idle `None` slots dropped: the
    simulator derives idleness from dependencies instead of from torch's lock-step padding.
    """
    rounds = max(1, n_mb // n_devices)
    per_round = n_mb // rounds
    # Warm-up: the last device runs (V-1) rounds of forwards before its first backward,
    # each earlier device two more per hop (one in flight each way), capped at all forwards.
    warmup = min((n_chunks - 1) * per_round + 2 * (n_devices - 1 - device), n_mb * n_chunks)
    total = n_mb * n_chunks

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % n_chunks) * n_devices + device

    def bwd_stage(step: int) -> int:
        return (n_chunks - 1 - ((step - warmup) // per_round) % n_chunks) * n_devices + device

    next_fwd: dict[int, int] = defaultdict(int)  # stage -> next micro-batch to forward
    next_bwd: dict[int, int] = defaultdict(int)
    order: list[Action] = []

    def emit(kind: str, stage: int, counter: dict[int, int]) -> None:
        order.append(Action(kind, counter[stage], stage))
        counter[stage] += 1

    # torch's op loop: ops [0, warmup) forward only, [warmup, V*M) one F then one B,
    # [V*M, V*M + warmup) backward only (cool-down).
    for op in range(total + warmup):
        if op < total:
            emit("F", fwd_stage(op), next_fwd)
        if op >= warmup:
            emit("B", bwd_stage(op), next_bwd)
    return order


def zbv_order(device: int, n_devices: int, n_mb: int) -> list[Action]:
    """Zero-bubble V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6), the order torch builds
    for ScheduleZBVZeroBubble: two stages per device in a V (``stage_device``), every backward split into
    I (the input gradient, which the previous stage waits for) and W (the weight gradient, which nobody
    waits for, so it can fill what would be bubble).

    Mirrors ScheduleZBVZeroBubble._calculate_single_rank_operations (torch 2.13): warm-up forwards of chunk 0,
    then chunk 1 / chunk 0 pairs, then chunk 1's F-I-W triples; a steady state of (F, I, W) on chunk 0 then on
    chunk 1; a cool-down of I's with W's deferred to the end. Torch plans max(2P-1, M) micro-batches and drops
    the actions of micro-batches >= M (and its idle `None` slots), as done here.
    """
    n_micro = max(2 * n_devices - 1, n_mb)
    c0, c1 = device, 2 * n_devices - 1 - device
    order: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (n_devices - device) - 1):  # warm-up 1: chunk 0 forwards
        order.append(Action("F", f0, c0))
        f0 += 1
    for _ in range(device):  # warm-up 2: chunk 1 / chunk 0 forwards
        order += [Action("F", f1, c1), Action("F", f0, c0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(n_devices - device):  # warm-up 3: chunk 1's first full backwards
        order += [Action("F", f1, c1), Action("I", b1, c1), Action("W", b1, c1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n_micro:  # steady state
        if f0 < n_micro:
            order.append(Action("F", f0, c0))
            f0 += 1
        order += [Action("I", b0, c0), Action("W", b0, c0), Action("F", f1, c1), Action("I", b1, c1), Action("W", b1, c1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1  # cool-down: input gradients first, weight gradients after
    for _ in range(device):
        order += [Action("I", b0, c0), Action("I", b1, c1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(n_devices - device):
        order += [Action("I", b0, c0), Action("W", w0, c0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [Action("W", m, c1) for m in range(w1, b1)]
    order += [Action("W", m, c0) for m in range(w0, b0)]
    return [a for a in order if a.microbatch < n_mb]


def device_orders(schedule: str, n_devices: int, n_mb: int, n_chunks: int = 1) -> dict[int, list[Action]]:
    """Ordered actions of ONE step (one optimizer update) for every device.

    For pipedream / pipedream-2bw pass the total number of micro-batches of the whole run:
    those schedules never flush, so the whole run is one continuous 1F1B stream.
    """
    if schedule in ("naive", "gpipe"):  # naive = GPipe with one micro-batch (the whole batch)
        return {d: gpipe_order(d, 1 if schedule == "naive" else n_mb) for d in range(n_devices)}
    if schedule in ("1f1b", "pipedream", "pipedream-2bw"):
        return {d: one_f_one_b_order(d, n_devices, n_mb) for d in range(n_devices)}
    if schedule == "interleaved-1f1b":
        return {d: interleaved_order(d, n_devices, n_chunks, n_mb) for d in range(n_devices)}
    if schedule == "zbv":
        return {d: zbv_order(d, n_devices, n_mb) for d in range(n_devices)}
    raise ValueError(f"unknown schedule {schedule!r}")
