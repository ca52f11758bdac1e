"""summary.json, typed: ``RunSummary`` and its one writer.

A run's summary is built by the trainer at the end of training (rank 0), then completed with the
run monitor's statistics (``gpu_monitor`` / ``cpu_monitor``) by the process that owns the monitor:
``merge_monitor`` is the one function that adds them, and ``RunSummary.write`` the one place that
writes the file (atomically: a temporary file renamed over it).

Reading is tolerant: a field an older file lacks reads as None (or its default), and keys this
class does not know are kept, in their place, so an older or newer file round-trips unchanged.
Only the keys a file holds (or a caller set) are written: a CPU run still has no ``gpu_mem_peak_gib``
key, as before. No torch import here: the report, bench and autobatch read summaries too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

SUMMARY_FILE = "summary.json"


class _Record:
    """A dataclass that remembers which keys it holds and in what order, and keeps the ones it does not know.

    ``extras``: keys of the JSON object that are not fields (strategy-specific figures, or keys of a
    newer file); written back in their place."""

    _keys: list[str]
    _nested: ClassVar[dict[str, type]] = {}  # field -> _Record subclass (a list of them when the field is a list)

    def __post_init__(self) -> None:
        # a record built in code holds the fields given a value other than their default
        keys = [f.name for f in dataclasses.fields(self) if f.name != "extras" and getattr(self, f.name) != _default(f)]
        object.__setattr__(self, "_keys", keys + [k for k in self.extras if k not in keys])

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        keys = self.__dict__.get("_keys")
        if keys is not None and name != "extras" and name in self._field_names() and name not in keys:
            keys.append(name)

    @classmethod
    def _field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extras"}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = cls._field_names()
        kwargs: dict[str, Any] = {}
        extras: dict[str, Any] = {}
        for k, v in data.items():
            if k in names:
                kwargs[k] = _load(cls._nested.get(k), v)
            else:
                extras[k] = v
        obj = cls(**kwargs, extras=extras)  # type: ignore[call-arg]
        object.__setattr__(obj, "_keys", list(data))
        return obj

    def to_dict(self) -> dict[str, Any]:
        names = self._field_names()
        out: dict[str, Any] = {}
        for k in self._keys:
            if k in names:
                out[k] = _dump(getattr(self, k))
            elif k in self.extras:
                out[k] = self.extras[k]
        for k, v in self.extras.items():  # added to extras after construction
            out.setdefault(k, v)
        return out

    def has(self, key: str) -> bool:
        """The record holds ``key`` (a field set or read from the file, or an extra)."""
        return key in self._keys or key in self.extras


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _load(kind: type | None, value: Any) -> Any:
    if kind is None or value is None:
        return value
    if isinstance(value, list):
        return [kind.from_dict(v) if isinstance(v, dict) else v for v in value]
    return kind.from_dict(value) if isinstance(value, dict) else value


def _dump(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# the run monitor's statistics (monitor.py)


@dataclass(eq=False)
class Stat(_Record):
    """Peak / mean / min of one sampled quantity (None when nothing was sampled)."""

    peak: float | None = None
    mean: float | None = None
    min: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class GpuStats(_Record):
    index: int | None = None
    name: str | None = None
    memory_total_mib: float | None = None
    memory_used_mib: Stat | None = None
    utilization_pct: Stat | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    _nested: ClassVar[dict[str, type]] = {"memory_used_mib": Stat, "utilization_pct": Stat}


@dataclass(eq=False)
class GpuMonitor(_Record):
    """``gpu_monitor``: NVML memory.used and utilisation over the whole run, or why there is none."""

    available: bool = False
    reason: str | None = None
    csv: str | None = None
    interval_s: float | None = None
    samples: int | None = None
    gpus: list[GpuStats] | None = None
    memory_used_mib: Stat | None = None  # the busiest GPU's peak, the mean over GPUs, the lowest minimum
    utilization_pct: Stat | None = None
    note: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    _nested: ClassVar[dict[str, type]] = {"gpus": GpuStats, "memory_used_mib": Stat, "utilization_pct": Stat}

    @property
    def sampled(self) -> bool:
        return bool(self.available and self.gpus and self.memory_used_mib and self.memory_used_mib.peak is not None)


@dataclass(eq=False)
class CpuMonitor(_Record):
    """``cpu_monitor``: RSS, virtual memory and CPU % summed over the run's process tree."""

    available: bool = False
    reason: str | None = None
    csv: str | None = None
    interval_s: float | None = None
    samples: int | None = None
    duration_s: float | None = None
    max_processes: int | None = None
    real_mb: Stat | None = None
    virtual_mb: Stat | None = None
    cpu_pct: Stat | None = None  # from the second sample on (the first has no interval)
    note: str | None = None
    scope: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    _nested: ClassVar[dict[str, type]] = {"real_mb": Stat, "virtual_mb": Stat, "cpu_pct": Stat}

    @property
    def sampled(self) -> bool:
        return bool(self.available and self.real_mb and self.real_mb.peak is not None)


# --------------------------------------------------------------------------------------------------
# stable nested records of the trainer's summary


@dataclass(eq=False)
class TimeSplit(_Record):
    """``time_split`` (offload strategies, timesplit.py): where one step's time goes, means over the steady steps."""

    steps_measured: int | None = None
    step_s: float | None = None
    gpu_compute_s: float | None = None
    cpu_optimizer_s: float | None = None
    idle_s: float | None = None
    transfer_s: float | None = None
    transfer_note: str | None = None
    h2d_gb_per_step: float | None = None
    d2h_gb_per_step: float | None = None
    pinned_h2d_gbps: float | None = None
    pinned_d2h_gbps: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class PlanRecord(_Record):
    """``plan`` (run_plan.py): the launcher's memory prediction; PLAN_KEYS always present, the rest for people."""

    gpu_peak_gib: float | None = None
    cpu_gib: float | None = None
    fits: bool | None = None
    strategy: str | None = None
    device: str | None = None
    error: str | None = None
    cpu_gib_cached: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# the summary


@dataclass(eq=False)
class RunSummary(_Record):
    """summary.json. Fields in the order the trainer writes them; ``extras``: strategy-specific figures
    (``pipeline``) and keys this version does not know."""

    model: str | None = None
    strategy: str | None = None
    precision: str | None = None
    device_type: str | None = None
    world_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    steps: int | None = None
    tokens_per_step: int | None = None
    n_params: int | None = None
    param_bytes: int | None = None
    adapter: dict[str, Any] | None = None  # training/adapters.summary: --peft settings and trainable/total parameters
    final_train_loss: float | None = None
    final_eval_loss: float | None = None
    final_eval_ppl: float | None = None
    non_pad_fraction: float | None = None
    warmup_steps_excluded: int | None = None
    total_time_s: float | None = None
    compile: bool | None = None
    compile_scope: str | None = None
    compile_mode: str | None = None
    sdpa_backend: str | None = None
    time_to_first_step_s: float | None = None
    startup_s: dict[str, float] | None = None  # measure/startup.py: the phases of time_to_first_step_s
    compile_time_s: float | None = None
    compile_time_source: str | None = None
    compile_cache: dict[str, Any] | None = None
    loss_kernel: str | None = None
    gradient_checkpointing: bool | None = None
    skipped_steps: int | None = None
    overflow_steps: int | None = None
    # throughput over the steady steps (metrics.throughput)
    step_time_median_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    tokens_per_s: float | None = None
    useful_tokens_per_s: float | None = None
    samples_per_s: float | None = None
    steps_per_s: float | None = None
    timed_steps: int | None = None
    # peak memory, the largest over ranks (metrics.peak_memory)
    gpu_mem_peak_gib: float | None = None
    gpu_mem_peak_reserved_gib: float | None = None
    cpu_rss_peak_rank_gib: float | None = None
    cpu_rss_max_rank_gib: float | None = None
    # evaluation and early stopping (early_stopping.EvalTracker)
    initial_eval_loss: float | None = None
    best_eval_loss: float | None = None
    best_step: int | None = None
    stopped_early: bool | None = None
    early_stopping_patience: int | None = None
    epochs: list[dict[str, Any]] | None = None
    # strategy extras that every strategy (or every offload strategy) writes (strategies/base.py)
    optimizer: str | None = None
    time_split: TimeSplit | None = None
    cpu_threads: int | None = None
    bound_cores: int | None = None
    thread_pin: dict[str, Any] | None = None  # runtime/pin.py: mode, the CPU pinned to (None: not pinned), why
    pinned_released_gib: dict[str, float] | None = None  # training/pinned.py: cached pinned host GiB given back, by moment
    eight_bit_warmup: dict[str, Any] | None = None  # loop/warm_8bit.py: graphs, seconds, GPU peak vs planned (GPU 8-bit runs)
    # MFU (mfu.summary_fields) and the projected epoch (metrics.run_stats)
    flops_per_token: int | None = None
    flops_formula: str | None = None
    flops_counted: str | None = None
    model_tflops_per_s: float | None = None
    device_name: str | None = None
    peak_tflops_per_device: float | None = None
    peak_math_mode: str | None = None
    mfu: float | None = None
    mfu_all_tokens: float | None = None
    mfu_note: str | None = None
    steps_per_epoch: int | None = None
    epoch_time_projected_s: float | None = None
    memory_per_rank: list[dict[str, Any]] | None = None
    # added after the training loop (trainer.run)
    plan: PlanRecord | None = None
    exported_step: int | None = None
    export_dir: str | None = None
    # the patches of dependencies' internals (compat/): applied by this run, and those left off with why
    patches: list[str] | None = None
    patches_off: dict[str, str] | None = None
    # the run monitor's statistics (merge_monitor)
    gpu_monitor: GpuMonitor | None = None
    cpu_monitor: CpuMonitor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    _nested: ClassVar[dict[str, type]] = {"time_split": TimeSplit, "plan": PlanRecord, "gpu_monitor": GpuMonitor,
                                          "cpu_monitor": CpuMonitor}

    @property
    def rate_includes_warm_up(self) -> bool:
        """A run of the warm-up's length or shorter has no step left to time without it (metrics.StepTimer.steady):
        its rate is the median of every step, compilation and allocator growth included."""
        return self.warmup_steps_excluded == 0 and bool(self.timed_steps)

    # ---- the file ---------------------------------------------------------------------------------
    @staticmethod
    def path(run_dir: str | Path) -> Path:
        return Path(run_dir) / SUMMARY_FILE

    @classmethod
    def read(cls, run_dir: str | Path) -> "RunSummary":
        """The run's summary.json (OSError when there is none, ValueError when it is not a JSON object)."""
        data = json.loads(cls.path(run_dir).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{cls.path(run_dir)} is not a JSON object")
        return cls.from_dict(data)

    @classmethod
    def read_or_none(cls, run_dir: str | Path) -> "RunSummary | None":
        try:
            return cls.read(run_dir)
        except (OSError, ValueError):
            return None

    def write(self, run_dir: str | Path) -> Path:
        """THE writer of summary.json: a temporary file in the run directory, renamed over the old one."""
        path = self.path(run_dir)
        tmp = path.with_name(f".{SUMMARY_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path


def merge_monitor(run_dir: str | Path, summary: RunSummary | dict[str, Any] | None,
                  monitor: dict[str, Any] | None) -> RunSummary | None:
    """The one place the run monitor's statistics join the trainer's summary; written once, here.

    ``summary``: the trainer's, in memory when the trainer ran in this process; None to read the one the
    run's rank 0 wrote into ``run_dir`` (spawned workers). Call it only once the run has ended well: the
    summary in ``run_dir`` is then this run's. Returns the merged summary (None when there is nothing
    to merge)."""
    if isinstance(summary, dict):
        summary = RunSummary.from_dict(summary)
    if summary is None:
        summary = RunSummary.read_or_none(run_dir)
    if summary is None or not monitor:
        return summary
    if "gpu_monitor" in monitor:
        summary.gpu_monitor = GpuMonitor.from_dict(monitor["gpu_monitor"])
    if "cpu_monitor" in monitor:
        summary.cpu_monitor = CpuMonitor.from_dict(monitor["cpu_monitor"])
    summary.write(run_dir)
    return summary


__all__ = ["RunSummary", "GpuMonitor", "CpuMonitor", "GpuStats", "Stat", "TimeSplit", "PlanRecord", "merge_monitor",
           "SUMMARY_FILE"]
