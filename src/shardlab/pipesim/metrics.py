"""What a timeline costs: utilisation, bubble, throughput, activation memory, weight versions.

Definitions (all per device d, over the whole simulated run starting at t=0):
  busy[d]       = sum of its event durations;  idle[d] = makespan - busy[d]
  bubble        = sum(idle) / (P * makespan)  = 1 - mean utilisation
  throughput    = naive makespan / makespan for the same work (same M, steps, stage times, comm)
  in-flight     = micro-batches whose forward has started and backward not finished on that
                  device (their activations are held); interleaved and zbv count (micro-batch, chunk).
                  Under a split backward (zbv) the backward finishes with its W: between its I and its W
                  a micro-batch still holds its activations (torch keeps the autograd graph for the W)
                  plus the gradients at every weight's output, the W's inputs ("W pending")
  weight versions held = distinct versions among in-flight micro-batches plus the newest weights
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .simulator import Timeline


def bubble_theory(schedule: str, P: int, M: int, V: int = 1) -> float | None:
    """Closed-form bubble for equal stages and zero comm, as this simulator reproduces it exactly.

    naive: (P-1)/P.  gpipe, 1f1b: (P-1)/(M+P-1), makespan (f+b)(M+P-1), for any fwd:bwd ratio.
    interleaved-1f1b (M divisible by P, each chunk costing 1/V of the device's time):
    (P-1)/(V*M+P-1), makespan (f+b)(M+(P-1)/V) -- Megatron's fill/drain shrunk V-fold.
    zbv (M >= 2P-1, so that torch's plan has no dropped micro-batches; F = I = W = t on every chunk, i.e. fwd 1 :
    bwd 2 with wgrad 0.5): makespan 6Mt + (P-1)t, bubble (P-1)/(6M+P-1) -- only the first forwards' fill is left.
    """
    if schedule == "naive":
        return (P - 1) / P
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (M + P - 1)
    if schedule == "interleaved-1f1b":
        return (P - 1) / (V * M + P - 1)
    if schedule == "zbv" and M >= 2 * P - 1:
        return (P - 1) / (6 * M + P - 1)
    return None


def compute_metrics(tl: "Timeline", simulate: Callable[..., "Timeline"]) -> dict[str, Any]:
    """The timeline's metrics; `simulate` (simulator.simulate, passed in: this module sits below it) runs the naive baseline."""
    P = tl.stages
    makespan = max(e.end for e in tl.events)
    busy = [0.0] * P
    for e in tl.events:
        busy[e.device] += e.duration
    idle = [makespan - b for b in busy]
    util = [b / makespan for b in busy]
    bubble = sum(idle) / (P * makespan)

    if tl.schedule == "naive":
        naive_makespan = makespan
    else:
        naive_makespan = simulate("naive", P, tl.microbatches, tl.fwd, tl.bwd, tl.comm, steps=tl.steps).makespan

    inflight, activations, versions, w_pending = _memory(tl)
    staleness: dict[int, list[int]] = defaultdict(lambda: [0] * (P * tl.chunks))
    for e in tl.events:
        if e.kind == "F":
            staleness[e.microbatch][e.stage] = e.staleness
    max_stale = [max((e.staleness for e in tl.events if e.device == d), default=0) for d in range(P)]
    theory = None
    equal = tl.comm == 0 and len(set(tl.stage_fwd)) == 1 and len(set(tl.stage_bwd)) == 1
    if tl.schedule == "zbv":  # the closed form needs F = I = W (the first stage's I is empty: its W is its whole backward)
        equal = equal and tl.stage_bwd[0] == 2 * tl.stage_fwd[0] and set(tl.wgrad[1:]) == {0.5}  # type: ignore[index]
    if tl.schedule != "pipedream" and tl.schedule != "pipedream-2bw" and equal:
        theory = bubble_theory(tl.schedule, P, tl.microbatches, tl.chunks)
    return {
        "makespan": makespan,
        "busy": busy,
        "idle": idle,
        "utilisation": util,
        "mean_utilisation": 1 - bubble,
        "bubble_fraction": bubble,
        "bubble_theory": theory,  # closed form when stages are equal and comm is 0 (synchronous only)
        "naive_makespan": naive_makespan,
        "throughput_vs_naive": naive_makespan / makespan,
        "microbatches_per_time": tl.steps * tl.microbatches / makespan,
        "peak_inflight": inflight,
        "peak_activations": activations,  # in units of one micro-batch through the device's whole share
        "peak_w_pending": w_pending,  # split backward: (micro-batch, chunk)s past their I, waiting for their W
        "weight_versions": versions,
        "max_staleness": max_stale,
        "staleness": dict(staleness),  # micro-batch -> staleness on each (virtual) stage
    }


def _memory(tl: "Timeline") -> tuple[list[int], list[float], list[int], list[int]]:
    """Peak in-flight micro-batches, activation memory, weight versions and pending W's per device (a sweep over time).

    A micro-batch's activations on a chunk are taken at its F's start and given back at the end of the action
    that completes its backward: B, or W under a split backward (whose I leaves them held for the W)."""
    P, M = tl.stages, tl.microbatches
    # naive: the single in-flight item is the whole batch, i.e. M micro-batches' activations
    size = M if tl.schedule == "naive" else 1 / tl.chunks
    peaks_n, peaks_a, peaks_v, peaks_w = [], [], [], []
    for d in range(P):
        changes = []  # (time, order, event): releases (B/W end, I end: order 0) before allocations (F start, order 1)
        for e in tl.events:
            if e.device != d:
                continue
            if e.kind == "F":
                changes.append((e.start, 1, e))
            else:
                changes.append((e.end, 0, e))
        changes.sort(key=lambda c: (c[0], c[1]))
        held: dict[tuple[int, int], int] = {}  # (micro-batch, chunk) -> weight version it uses
        pending: set[tuple[int, int]] = set()  # split backward: I done, W not yet
        newest = 0
        backwards = defaultdict(int)  # step -> backwards finished (to know when a batch is done)
        per_step = M * tl.chunks if tl.schedule != "naive" else 1
        peak_n = peak_v = peak_w = 0
        for _, order, e in changes:
            key = (e.microbatch, e.chunk)
            if order == 1:
                held[key] = e.version
            elif e.kind == "I":
                pending.add(key)
            else:
                held.pop(key, None)
                pending.discard(key)
                backwards[e.step] += 1
                if tl.schedule == "pipedream":
                    newest += 1  # PipeDream updates after every micro-batch's backward
                elif backwards[e.step] == per_step:
                    newest = e.step + 1  # others: after a whole step / batch of M
            peak_n = max(peak_n, len(held))
            peak_w = max(peak_w, len(pending))
            # held = versions an in-flight micro-batch still needs (stashed) + the newest weights
            peak_v = max(peak_v, len(set(held.values()) | {newest}))
        peaks_n.append(peak_n)
        peaks_a.append(peak_n * size)
        peaks_v.append(peak_v)
        peaks_w.append(peak_w)
    return peaks_n, peaks_a, peaks_v, peaks_w
