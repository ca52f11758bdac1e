"""`--profile`: torch.profiler over a few steady-state optimizer steps, one trace per rank.

Skips the warm-up steps (allocator growth, autotuning, compile), then records `ACTIVE_STEPS`
steps and writes into `<run_dir>/profile/`:
  trace_rank<R>.json   Chrome/Perfetto trace (open in https://ui.perfetto.dev or chrome://tracing)
  ops_rank<R>.txt      operator table sorted by self device time (self CPU time on CPU runs)
  ops_rank<R>.json     the same per operator, machine-readable (benchmarks/profile_dp.py diffs two of them)
  steps_rank<R>.json   per-step wall time vs device busy time: their difference is time the GPU sat idle
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from .metrics import WARMUP_STEPS

ACTIVE_STEPS = 4


def device_busy_us(events, device_type: str) -> float:
    """Sum of the device-side kernel/memcpy durations (µs) in a profiler's event list."""
    if device_type != "cuda":
        return 0.0
    total = 0.0
    for evt in events:
        # ProfilerStep#N also appears on the device timeline, as an annotation spanning the whole step.
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA and not evt.name.startswith("ProfilerStep"):
            total += evt.self_device_time_total
    return total


class StepProfiler:
    """Call `step(wall_s)` after every optimizer step; a no-op unless enabled."""

    def __init__(self, run_dir: Path | None, rank: int, device: torch.device, enabled: bool, skip: int = WARMUP_STEPS + 1):
        self.enabled = enabled and run_dir is not None
        self._prof = None
        if not self.enabled:
            return
        self.out = Path(run_dir) / "profile"
        self.out.mkdir(parents=True, exist_ok=True)
        self.rank, self.device = rank, device
        self._walls: list[float] = []
        self._steps_seen = 0
        self._skip = skip
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=max(0, skip - 1), warmup=1, active=ACTIVE_STEPS, repeat=1),
            on_trace_ready=self._write,
        )
        self._prof.__enter__()

    def step(self, wall_s: float) -> None:
        if self._prof is None:
            return
        if self._skip <= self._steps_seen < self._skip + ACTIVE_STEPS:
            self._walls.append(wall_s)
        self._steps_seen += 1
        self._prof.step()
        if self._steps_seen >= self._skip + ACTIVE_STEPS:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _write(self, prof) -> None:
        r = self.rank
        prof.export_chrome_trace(str(self.out / f"trace_rank{r}.json"))
        cuda = self.device.type == "cuda"
        averages = prof.key_averages()
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        (self.out / f"ops_rank{r}.txt").write_text(averages.table(sort_by=sort, row_limit=60, max_name_column_width=70))
        ops = [{"name": a.key, "calls": a.count, "self_device_us": a.self_device_time_total, "self_cpu_us": a.self_cpu_time_total}
               for a in averages]
        (self.out / f"ops_rank{r}.json").write_text(json.dumps(ops))
        busy = device_busy_us(prof.events(), self.device.type) / 1e3 / ACTIVE_STEPS
        walls_ms = [w * 1e3 for w in self._walls]
        record = {
            "active_steps": ACTIVE_STEPS,
            "step_wall_ms": walls_ms,
            "mean_step_wall_ms": sum(walls_ms) / len(walls_ms) if walls_ms else None,
            "mean_device_busy_ms": busy if cuda else None,
        }
        if cuda and walls_ms:
            record["mean_device_idle_ms"] = record["mean_step_wall_ms"] - busy
        (self.out / f"steps_rank{r}.json").write_text(json.dumps(record, indent=1))
