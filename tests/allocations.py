"""The peak of torch.profiler's recorded allocations (used by test_plan.py and pipeline_memory_probe.py)."""

from __future__ import annotations


def peak_allocated(prof) -> int:
    """Largest running sum of allocations minus frees inside a `profile(profile_memory=True)` window, in bytes.
    The profiler does not see frees of blocks allocated before the window started."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak
