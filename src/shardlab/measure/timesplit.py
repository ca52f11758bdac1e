"""Where an offload step's time goes: GPU compute, host<->device transfers, CPU optimizer, idle.

Recorded for strategies that step the optimizer on the CPU (Strategy.cpu_optimizer). Per step:

- ``gpu_compute_s``: forward and backward of all micro-batches, timed by CUDA events on the compute
  stream (on a CPU run: the host wall time of the same span). Copies that the compute stream waits for
  (a gradient bucket that must reach the host before backward goes on) count here.
- ``cpu_optimizer_s``: the wall time of the optimizer step, up to a device synchronise at its end: the
  CPU AdamW and the copies of updated weights back to the GPU that it waits for.
- ``idle_s``: the rest of the step (host work between the two, data, Python): step - compute - optimizer.
- ``transfer_s``: the step's host<->device bytes (what the strategy moves per parameter) over the pinned
  copy bandwidth measured once at setup: an estimate of the copy time, which runs *overlapped* with the
  parts above (it is not a fourth slice of the step; a user sees whether the link could be the limit).

Means over the steps after the first WARMUP_STEPS (metrics.py), like the throughput figures.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from .metrics import WARMUP_STEPS


def pinned_bandwidth(device: torch.device, nbytes: int = 256 * 2**20) -> dict[str, float]:
    """Host->device and device->host copy bandwidth (bytes/s) from pinned memory, measured once."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[name] = 3 * nbytes / (start.elapsed_time(end) / 1e3)
    return out


class StepSplit:
    def __init__(self, device: torch.device, enabled: bool, h2d_bytes: float = 0.0, d2h_bytes: float = 0.0):
        self.device, self.enabled = device, enabled
        self.cuda = device.type == "cuda"
        self.h2d_bytes, self.d2h_bytes = h2d_bytes, d2h_bytes
        self.bandwidth = pinned_bandwidth(device) if enabled and self.cuda else None
        self.rows: list[tuple[float, float, float]] = []  # (step, compute, optimizer) seconds
        self._t0 = 0.0
        self._events: tuple | None = None
        self._compute_wall = 0.0

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def compute_start(self) -> None:
        if not self.enabled:
            return
        self._t0 = time.perf_counter()
        self._events = (self._event(),) if self.cuda else None

    def compute_end(self) -> None:
        if not self.enabled:
            return
        if self.cuda:
            self._events = (self._events[0], self._event())
        else:
            self._compute_wall = time.perf_counter() - self._t0

    @contextlib.contextmanager
    def optimizer(self):
        if not self.enabled:
            yield
            return
        t = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        compute = self._events[0].elapsed_time(self._events[1]) / 1e3 if self.cuda else self._compute_wall
        self.rows.append((end - self._t0, compute, end - t))

    def summary(self) -> dict[str, Any]:
        if not self.enabled or not self.rows:
            return {}
        rows = self.rows[WARMUP_STEPS:] or self.rows
        step, compute, opt = (statistics.fmean(col) for col in zip(*rows))
        out: dict[str, Any] = {"steps_measured": len(rows), "step_s": step, "gpu_compute_s": compute, "cpu_optimizer_s": opt,
                               "idle_s": max(0.0, step - compute - opt)}
        if self.bandwidth:
            out["transfer_s"] = self.h2d_bytes / self.bandwidth["h2d"] + self.d2h_bytes / self.bandwidth["d2h"]
            out["transfer_note"] = "estimate (bytes moved / pinned bandwidth measured at setup); overlaps the other parts"
            out["h2d_gb_per_step"], out["d2h_gb_per_step"] = self.h2d_bytes / 1e9, self.d2h_bytes / 1e9
            out["pinned_h2d_gbps"], out["pinned_d2h_gbps"] = self.bandwidth["h2d"] / 1e9, self.bandwidth["d2h"] / 1e9
        return out

    def describe(self) -> str:
        s = self.summary()
        if not s:
            return ""
        parts = [f"GPU compute {s['gpu_compute_s']:.3g} s", f"CPU optimizer {s['cpu_optimizer_s']:.3g} s", f"idle {s['idle_s']:.3g} s"]
        if "transfer_s" in s:
            parts.append(f"transfers ~{s['transfer_s']:.3g} s (overlapped)")
        return f"time split per step ({s['step_s']:.3g} s): " + ", ".join(parts)
