"""Samplers that watch a whole run from the launching process: GPUs through NVML, the process tree through psutil.

What the tutorials collect by hand with ``nvidia-smi --query-gpu ... -l 1`` and ``psrecord``,
recorded in every run directory:

* ``gpu_memory.csv``  timestamp, index, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%]
  (nvidia-smi's column names), one row per GPU per sample. NVML sees the whole device: CUDA
  context, NCCL buffers and other processes' memory included, unlike torch's allocator counters.
* ``cpu_memory.csv``  Elapsed time, CPU (%), Real (MB), Virtual (MB) (psrecord's columns), summed over
  the launcher and every process below it: all ranks and their children (DeepSpeed's CPU-offload
  buffers and data-loader workers live there). RSS counts shared pages once per process, as psrecord
  does, so the sum over ranks overstates what the node really uses by the shared libraries.

The samplers start in the process that launches the workers (``launch.train``), so the tree
contains every rank from start-up to exit; start-up and shutdown samples are kept, as in the
tutorials' CSVs. Samples are held in memory until this run has written its ``config.yaml``
(a run that fails on bad input leaves nothing behind), then streamed to the CSVs. When the run
ends the launcher adds ``gpu_monitor`` and ``cpu_monitor`` (peak / mean / min) to ``summary.json`` (summary.merge_monitor).
"""

from __future__ import annotations

import contextlib
import csv
import os
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import psutil

from .. import messages
from ..layout import local_world_size

# Lazy import below: pynvml only on a machine with NVIDIA GPUs to watch.

GPU_CSV = "gpu_memory.csv"
CPU_CSV = "cpu_memory.csv"
GPU_COLUMNS = ["timestamp", "index", "name", "memory.used [MiB]", "memory.total [MiB]", "utilization.gpu [%]"]
CPU_COLUMNS = ["Elapsed time", "CPU (%)", "Real (MB)", "Virtual (MB)", "Processes"]
MIB = 2**20
DEFAULT_INTERVAL_S = 0.5


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"peak": None, "mean": None, "min": None}
    return {"peak": max(values), "mean": statistics.fmean(values), "min": min(values)}


class Running:
    """Peak / mean / min of a stream, in constant memory (a run may last days)."""

    def __init__(self):
        self.n, self.total, self.peak, self.low = 0, 0.0, None, None

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.peak = value if self.peak is None else max(self.peak, value)
        self.low = value if self.low is None else min(self.low, value)

    def summary(self) -> dict[str, float | None]:
        return {"peak": self.peak, "mean": self.total / self.n if self.n else None, "min": self.low}


class _Sampler:
    """A daemon thread calling ``sample()`` every ``interval`` seconds; rows go to a CSV once ``ready()``."""

    columns: list[str] = []

    def __init__(self, path: Path, interval: float, ready: Callable[[], bool]):
        self.path, self.interval, self.ready = Path(path), interval, ready
        self.n_rows = 0
        self._pending: list[list[Any]] = []  # rows not yet in the CSV (until the run directory is this run's)
        self._file = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self.error: str | None = None

    def start(self) -> "_Sampler":
        self._tick()  # one sample at once: even a very short run has its start-up recorded
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._tick()

    def _tick(self) -> None:
        try:
            rows = self.sample()
        except Exception as exc:  # noqa: BLE001 - a vanished process, an NVML hiccup: skip this tick, never stop the run
            self.error = f"{type(exc).__name__}: {exc}"
            rows = []
        for row in rows:
            self.accumulate(row)
        self.n_rows += len(rows)
        self._pending.extend(rows)
        self._flush()

    def _flush(self) -> None:
        if self._file is None:
            if not self.ready():
                return
            self._file = open(self.path, "w", newline="")  # noqa: SIM115 - closed in stop()
            csv.writer(self._file).writerow(self.columns)
        if self._pending:
            csv.writer(self._file).writerows(self._pending)
            self._pending.clear()
            self._file.flush()

    def stop(self) -> bool:
        """Stop sampling; True when the CSV was written (the run directory belongs to this run)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._tick()  # the final state
        if self._file is not None:
            self._file.close()
            return True
        return False

    def sample(self) -> list[list[Any]]:
        raise NotImplementedError

    def accumulate(self, row: list[Any]) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# CPU: the process tree


class ProcessTreeSampler(_Sampler):
    """psrecord-style samples of one process and all its descendants (RSS, VMS and CPU % summed)."""

    columns = CPU_COLUMNS

    def __init__(self, path: Path, interval: float = DEFAULT_INTERVAL_S, ready: Callable[[], bool] = lambda: True,
                 root_pid: int | None = None):
        super().__init__(path, interval, ready)
        self.root = psutil.Process(root_pid or os.getpid())
        self.t0 = time.monotonic()
        self._last_t = self.t0
        self._cpu_seen: dict[tuple[int, float], float] = {}  # (pid, create_time) -> cpu seconds at the last sample
        self.max_processes = 0
        self.real, self.virtual, self.cpu_pct = Running(), Running(), Running()
        self.duration = 0.0

    def _tree(self) -> list[psutil.Process]:
        procs = [self.root]
        try:
            procs += self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        return procs

    def sample(self) -> list[list[Any]]:
        now = time.monotonic()
        rss = vms = cpu_s = 0.0
        alive = 0
        seen: dict[tuple[int, float], float] = {}
        for p in self._tree():
            try:
                with p.oneshot():
                    mem = p.memory_info()
                    t = p.cpu_times()
                    key = (p.pid, p.create_time())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            alive += 1
            rss += mem.rss
            vms += mem.vms
            used = t.user + t.system
            seen[key] = used
            # A process born since the last sample counts all its CPU time; one seen before, the increase.
            cpu_s += used - self._cpu_seen.get(key, 0.0 if key[1] >= self._wall(self._last_t) else used)
        dt = now - self._last_t
        cpu_pct = 100.0 * cpu_s / dt if dt > 0 and self._cpu_seen else 0.0
        self._cpu_seen, self._last_t = seen, now
        self.max_processes = max(self.max_processes, alive)
        return [[round(now - self.t0, 3), round(cpu_pct, 1), round(rss / 1e6, 3), round(vms / 1e6, 3), alive]]

    def _wall(self, mono: float) -> float:
        """A monotonic instant as wall-clock seconds (psutil's create_time is wall-clock)."""
        return time.time() - (time.monotonic() - mono)

    def accumulate(self, row: list[Any]) -> None:
        if self.n_rows:  # the first sample has no interval to measure CPU time over
            self.cpu_pct.add(row[1])
        self.real.add(row[2])
        self.virtual.add(row[3])
        self.duration = row[0]

    def summary(self) -> dict[str, Any]:
        return {
            "available": True,
            "csv": self.path.name,
            "interval_s": self.interval,
            "samples": self.n_rows,
            "duration_s": self.duration,
            "max_processes": self.max_processes,
            "real_mb": self.real.summary(),
            "virtual_mb": self.virtual.summary(),
            "cpu_pct": self.cpu_pct.summary(),
            "note": "RSS and CPU summed over the process tree (shared pages counted once per process, as psrecord does)",
        }


# --------------------------------------------------------------------------------------------------
# GPU: NVML


class Nvml:
    """The few NVML calls the sampler makes (nvidia-ml-py), behind one small seam."""

    def __init__(self):
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()

    def handles(self, visible: list[str] | None) -> list[tuple[int, Any]]:
        """(CUDA index as the run sees it, NVML handle) for the GPUs the run may use."""
        nv = self.nv
        if visible is None:
            return [(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(nv.nvmlDeviceGetCount())]
        out = []
        for i, token in enumerate(visible):
            if token.startswith("GPU-"):
                out.append((i, nv.nvmlDeviceGetHandleByUUID(token)))
            elif token.isdigit():
                out.append((i, nv.nvmlDeviceGetHandleByIndex(int(token))))
            # MIG-... instances: NVML reports their memory elsewhere; not sampled
        return out

    def read(self, handle: Any) -> tuple[str, float, float, float]:
        nv = self.nv
        name = nv.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        util = nv.nvmlDeviceGetUtilizationRates(handle).gpu
        return name, mem.used / MIB, mem.total / MIB, float(util)

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that may already be gone
            pass


def visible_devices() -> list[str] | None:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [t.strip() for t in raw.split(",") if t.strip()]


class GpuSampler(_Sampler):
    """nvidia-smi-style samples of the GPUs the run uses (CUDA indices 0..n-1 as the run sees them)."""

    columns = GPU_COLUMNS

    def __init__(self, path: Path, nvml: Any, n_gpus: int | None = None, interval: float = DEFAULT_INTERVAL_S,
                 ready: Callable[[], bool] = lambda: True):
        super().__init__(path, interval, ready)
        self.nvml = nvml
        self.devices = nvml.handles(visible_devices())
        if n_gpus is not None:
            self.devices = self.devices[:n_gpus]
        self.per_gpu: dict[int, dict[str, Any]] = {}
        self.util = Running()

    def sample(self) -> list[list[Any]]:
        stamp = datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]  # nvidia-smi's timestamp format
        rows = []
        for index, handle in self.devices:
            name, used, total, util = self.nvml.read(handle)
            rows.append([stamp, index, name, round(used, 1), round(total, 1), util])
        return rows

    def stop(self) -> bool:
        written = super().stop()
        self.nvml.close()
        return written

    def accumulate(self, row: list[Any]) -> None:
        _, index, name, used, total, util = row
        g = self.per_gpu.setdefault(index, {"name": name, "total": total, "used": Running(), "util": Running()})
        g["used"].add(used)
        g["util"].add(util)
        self.util.add(util)

    def summary(self) -> dict[str, Any]:
        gpus = [{"index": i, "name": g["name"], "memory_total_mib": g["total"], "memory_used_mib": g["used"].summary(),
                 "utilization_pct": g["util"].summary()} for i, g in sorted(self.per_gpu.items())]
        peaks = [g["memory_used_mib"]["peak"] for g in gpus]
        means = [g["memory_used_mib"]["mean"] for g in gpus]
        mins = [g["memory_used_mib"]["min"] for g in gpus]
        return {
            "available": True,
            "csv": self.path.name,
            "interval_s": self.interval,
            "samples": min(g["used"].n for g in self.per_gpu.values()) if self.per_gpu else 0,
            "gpus": gpus,
            # the busiest GPU's peak (the one that runs out first), the mean over GPUs, the lowest minimum
            "memory_used_mib": {"peak": max(peaks) if peaks else None, "mean": statistics.fmean(means) if means else None,
                                "min": min(mins) if mins else None},
            "utilization_pct": self.util.summary(),
            "note": "NVML memory.used over the whole run (start-up included): CUDA context, NCCL and allocator cache included",
        }


def start_gpu_sampler(path: Path, n_gpus: int | None, interval: float, ready: Callable[[], bool],
                      nvml_factory: Callable[[], Any] = Nvml) -> tuple[GpuSampler | None, str | None]:
    """A running GpuSampler, or (None, why not) when there is no NVML / no GPU."""
    try:
        nvml = nvml_factory()
    except Exception as exc:  # noqa: BLE001 - no driver, no library, no GPU: all mean "not sampled"
        return None, f"NVML unavailable ({type(exc).__name__}: {exc})"
    try:
        sampler = GpuSampler(path, nvml, n_gpus, interval, ready)
    except Exception as exc:  # noqa: BLE001
        nvml.close()
        return None, f"NVML could not list the GPUs ({type(exc).__name__}: {exc})"
    if not sampler.devices:
        nvml.close()
        return None, "no GPU visible to NVML"
    return sampler.start(), None


# --------------------------------------------------------------------------------------------------
# The run's monitor, owned by the launching process


def _tree_root(in_launched_job: bool) -> tuple[int, str]:
    """The process whose tree is this node's run, and what that tree is."""
    me = psutil.Process()
    if in_launched_job and local_world_size() > 1:
        try:
            parent = me.parent()
            cmd = " ".join(parent.cmdline()) if parent else ""
        except psutil.Error:
            parent, cmd = None, ""
        if parent is not None and any(k in cmd or k in parent.name() for k in ("torchrun", "torch.distributed.run", "deepspeed", "slurmstepd")):
            return parent.pid, f"the launcher ({parent.name()}) and every local rank below it"
    if in_launched_job:
        return me.pid, "this rank's process and its children only (started by an external launcher)"
    return me.pid, "the shardlab launcher, every worker rank and their children"


class RunMonitor:
    """Context manager: samplers for one run, then their summaries (merged into summary.json by the launcher)."""

    def __init__(self, run_dir: str | Path, *, device_type: str, n_gpus: int | None, interval: float = DEFAULT_INTERVAL_S,
                 in_launched_job: bool = False, node_rank: int = 0, nvml_factory: Callable[[], Any] = Nvml):
        self.run_dir = Path(run_dir)
        self.t_start = time.time()
        suffix = "" if node_rank == 0 else f".node{node_rank}"
        root, scope = _tree_root(in_launched_job)
        self.scope = scope
        self.cpu = ProcessTreeSampler(self.run_dir / CPU_CSV.replace(".csv", f"{suffix}.csv"), interval, self._ready, root)
        self.gpu: GpuSampler | None = None
        self.gpu_note: str | None = "CPU run: no GPU to sample" if device_type != "cuda" else None
        if device_type == "cuda":
            self.gpu, self.gpu_note = start_gpu_sampler(self.run_dir / GPU_CSV.replace(".csv", f"{suffix}.csv"), n_gpus,
                                                        interval, self._ready, nvml_factory)
        self.cpu.start()

    def _ready(self) -> bool:
        """This run has made its run directory (its config.yaml is newer than the monitor)."""
        cfg = self.run_dir / "config.yaml"
        try:
            return cfg.stat().st_mtime >= self.t_start - 1.0
        except OSError:
            return False

    def __enter__(self) -> "RunMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def summaries(self) -> dict[str, Any]:
        cpu = {**self.cpu.summary(), "scope": self.scope}
        gpu = self.gpu.summary() if self.gpu is not None else {"available": False, "reason": self.gpu_note}
        return {"gpu_monitor": gpu, "cpu_monitor": cpu}

    def finish(self) -> dict[str, Any] | None:
        """Stop sampling; return the summaries (None when nothing was recorded). The launcher merges them into
        summary.json (summary.merge_monitor) once the run has ended well; the monitor writes no summary itself."""
        wrote = self.cpu.stop()
        if self.gpu is not None:
            wrote = self.gpu.stop() or wrote
        if not wrote:
            return None
        return self.summaries()


def describe(result: dict[str, Any]) -> str:
    """One log line for the end of a run."""
    parts = []
    gpu, cpu = result.get("gpu_monitor", {}), result.get("cpu_monitor", {})
    if gpu.get("available"):
        m = gpu["memory_used_mib"]
        parts.append(f"GPU memory.used peak {m['peak'] / 1024:.2f} GiB, mean {m['mean'] / 1024:.2f}, min {m['min'] / 1024:.2f} "
                     f"(NVML, {len(gpu['gpus'])} GPU(s)) -> {gpu['csv']}")
    if cpu.get("available") and cpu["real_mb"]["peak"] is not None:
        c = cpu["real_mb"]
        mean_cpu = cpu["cpu_pct"]["mean"]
        parts.append(f"process tree RSS peak {c['peak'] / 1e3:.2f} GB, mean {c['mean'] / 1e3:.2f} GB, CPU mean "
                     f"{0 if mean_cpu is None else mean_cpu:.0f}% ({cpu['max_processes']} processes) -> {cpu['csv']}")
    return "; ".join(parts)


class _Watch:
    """What `watch` yields: the monitor's summaries once the run has ended (None when nothing was recorded)."""

    result: dict[str, Any] | None = None


@contextlib.contextmanager
def watch(cfg: Any, device_type: str, nproc: int, in_launched_job: bool):
    """Monitor one run from the launching process (in a job started by torchrun/srun: local rank 0 only)."""
    watched = _Watch()
    if in_launched_job and os.environ.get("LOCAL_RANK", "0") != "0":
        yield watched
        return
    mon = RunMonitor(cfg.output_dir, device_type=device_type, n_gpus=nproc if device_type == "cuda" else None,
                     interval=cfg.monitor_interval_s, in_launched_job=in_launched_job, node_rank=cfg.node_rank)
    try:
        yield watched
    finally:
        watched.result = mon.finish()
        if watched.result and os.environ.get("RANK", "0") == "0":
            line = describe(watched.result)
            if line:
                messages.info(line)


__all__ = ["watch", "RunMonitor", "ProcessTreeSampler", "GpuSampler", "Nvml", "start_gpu_sampler", "stats", "describe",
           "GPU_CSV", "CPU_CSV", "GPU_COLUMNS", "CPU_COLUMNS"]
