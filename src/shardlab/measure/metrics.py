"""What a run measures about itself: step times, throughput, memory, and where it writes them.

Throughput figures exclude the first `WARMUP_STEPS` optimizer steps (allocator growth,
kernel autotuning, DeepSpeed bucket setup, torch.compile) and say so in the summary.
Rates are medians over steps, robust to the odd slow step (eval, checkpoint, GC).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from . import mfu
from .records import read_jsonl, write_text_atomic

# Lazy import below: tensorboard is optional (the `tensorboard` extra) and slow to import; only --tensorboard runs need it.

WARMUP_STEPS = 3
GIB = 2**30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time per optimizer step, with the device synchronised so the time is the GPU's too."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []
        self._t0: float | None = None

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        sync(self.device)
        assert self._t0 is not None
        dt = time.perf_counter() - self._t0
        self.times.append(dt)
        return dt

    def steady(self) -> list[float]:
        """Step times after warm-up (all of them when a run is too short to have a warm-up)."""
        return self.times[WARMUP_STEPS:] if len(self.times) > WARMUP_STEPS else self.times


def memory_snapshot(device: torch.device) -> dict[str, float]:
    """Allocator figures on GPU (this rank), resident set size on CPU, in GiB."""
    out = {"cpu_rss_gib": psutil.Process(os.getpid()).memory_info().rss / GIB}
    if device.type == "cuda":
        out.update(
            gpu_mem_alloc_gib=torch.cuda.memory_allocated(device) / GIB,
            gpu_mem_reserved_gib=torch.cuda.memory_reserved(device) / GIB,
            gpu_mem_peak_gib=torch.cuda.max_memory_allocated(device) / GIB,
            gpu_mem_peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
        )
    return out


def gather_rank_memory(env) -> list[dict[str, float]]:
    """Every rank's memory_snapshot (allocated / reserved / peaks on GPU, RSS on CPU), collected on all ranks."""
    snap = memory_snapshot(env.device)
    keys = sorted(snap)
    values = torch.tensor([snap[k] for k in keys], dtype=torch.float64, device=env.device)
    gathered = [values]
    if env.is_distributed:
        gathered = [torch.zeros_like(values) for _ in range(env.world_size)]
        dist.all_gather(gathered, values)
    return [{"rank": r, **{k: round(v, 4) for k, v in zip(keys, t.tolist())}} for r, t in enumerate(gathered)]


def peak_memory(env) -> dict[str, float]:
    """Peak memory, maximised over ranks (the rank that OOMs first is the one that matters)."""
    snap = memory_snapshot(env.device)
    # The rank's own peak RSS (the kernel's high-water mark of this process alone: not the launcher's, nor that of
    # a compiler DeepSpeed runs to build an op, which the monitor's process-tree sum includes).
    snap["cpu_rss_peak_rank_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    keys = [k for k in ("gpu_mem_peak_gib", "gpu_mem_peak_reserved_gib", "cpu_rss_gib", "cpu_rss_peak_rank_gib") if k in snap]
    vals = torch.tensor([snap[k] for k in keys], dtype=torch.float64, device=env.device)
    if env.is_distributed:
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    out = dict(zip(keys, vals.tolist()))
    if "cpu_rss_gib" in out:
        out["cpu_rss_max_rank_gib"] = out.pop("cpu_rss_gib")
    return out


def run_stats(summary: dict[str, Any], model_info: dict[str, Any], env, steps_per_epoch: int) -> dict[str, Any]:
    """Summary keys beyond throughput: MFU, the time of one whole epoch at the measured rate, per-rank memory.

    Collective (every rank calls it). The epoch time is projected from the median step time
    (warm-up excluded), so runs capped by --max-steps still report a comparable "time per epoch".
    """
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
    out = mfu.summary_fields(summary, model_info, device_name, tf32_enabled=torch.get_float32_matmul_precision() != "highest")
    med = summary.get("step_time_median_s")
    out["steps_per_epoch"] = steps_per_epoch
    out["epoch_time_projected_s"] = steps_per_epoch * med if med else None
    out["memory_per_rank"] = gather_rank_memory(env)
    return out


def throughput(step_times: list[float], tokens_per_step: int, useful_tokens_per_step: float, samples_per_step: int) -> dict[str, float]:
    if not step_times:
        return {}
    med = statistics.median(step_times)
    return {
        "step_time_median_s": med,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "tokens_per_s": tokens_per_step / med,
        "useful_tokens_per_s": useful_tokens_per_step / med,
        "samples_per_s": samples_per_step / med,
        "steps_per_s": 1.0 / med,
        "timed_steps": len(step_times),
    }


def drop_rows_after(path: Path, step: int) -> None:
    """On resume, forget what a killed run logged after its last checkpoint: those steps are run and logged again. A
    torn last line (the kill came mid-write) goes too; the file is replaced whole (records.py), so a second kill here
    leaves the old file or the new one."""
    if not path.is_file():
        return
    keep = [row for row in read_jsonl(path) if row.get("step", 0) <= step]
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in keep))


class MetricsWriter:
    """metrics.jsonl (one row per logged step) plus optional TensorBoard / W&B; rank 0 only."""

    def __init__(self, run_dir: Path | None, enabled: bool, tensorboard: bool = False, wandb_run: Any = None, append: bool = True):
        self.enabled = enabled and run_dir is not None
        # A resumed run continues the file; a fresh run into an old output_dir starts it over (no mixed runs).
        self._file = open(run_dir / "metrics.jsonl", "a" if append else "w") if self.enabled else None  # noqa: SIM115
        self._tb = None
        self._wandb = wandb_run if self.enabled else None
        if self.enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed; `pip install tensorboard` to enable it (continuing without)")

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        step = row.get("step", 0)
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
