"""Memory tables: GPU and host memory over each whole run, the memory planner's prediction against the measurement,
and a model that does not fit (every offload strategy and optimizer option side by side, its plan beside it).

Built on tables.py (its figures and row helpers); report/__init__.py puts these tables in order.
"""

from __future__ import annotations

from typing import Any

from . import tables as _tables
from .load import Cell, Spread
from .tables import Column, Table, basic_row, cell_status, cpu, gib_from_gb, group_by, med, nvml, planned_host_gib, torch_peak, where_ran


# --------------------------------------------------------------------------------------------------
# memory over the whole run (the nvidia-smi and psrecord CSVs)


GPU_MEM_COLUMNS = [
    Column("label", "Run", "text"), Column("gpus", "GPUs", "int"), Column("nvml_peak_gib", "Used peak (GiB)", "gib"),
    Column("nvml_mean_gib", "Used mean (GiB)", "gib"), Column("nvml_min_gib", "Used min (GiB)", "gib"),
    Column("util_mean", "Util mean %", "num"), Column("gpu_peak_gib", "torch peak allocated (GiB)", "gib"),
    Column("gpu_reserved_gib", "torch peak reserved (GiB)", "gib"), Column("status", "Status", "text"),
]
CPU_MEM_COLUMNS = [
    Column("label", "Run", "text"), Column("processes", "Processes", "int"), Column("cpu_rss_peak_gb", "Real peak (GB)", "gb"),
    Column("cpu_rss_mean_gb", "Real mean (GB)", "gb"), Column("virtual_peak_gb", "Virtual peak (GB)", "gb"),
    Column("cpu_pct_mean", "CPU % mean", "num"), Column("cpu_pct_peak", "CPU % peak", "num"),
    Column("rank_rss_gb", "Largest rank RSS (GB)", "gb"), Column("status", "Status", "text"),
]


def memory_tables(cells: list[Cell]) -> list[Table]:
    gpu_rows, cpu_rows = [], []
    for c in cells:
        if not c.ok:
            continue
        # looked up in tables.py, as nvml() and cpu() do: a test that swaps the figures' source there reaches all three
        if any(_tables.gpu_monitor_stats(r) for r in c.runs):
            gpu_rows.append({"label": c.label, "gpus": c.world, "nvml_peak_gib": nvml(c, "peak"), "nvml_mean_gib": nvml(c, "mean"),
                             "nvml_min_gib": nvml(c, "min"), "util_mean": nvml(c, "util_mean"), "gpu_peak_gib": torch_peak(c),
                             "gpu_reserved_gib": c.stat("gpu_mem_peak_reserved_gib"), "status": cell_status(c)})
        cpu_rows.append({"label": c.label, "processes": c.stat(lambda r: r.typed.cpu_monitor.max_processes),
                         "cpu_rss_peak_gb": cpu(c, "real_peak"), "cpu_rss_mean_gb": cpu(c, "real_mean"),
                         "virtual_peak_gb": cpu(c, "virtual_peak"), "cpu_pct_mean": cpu(c, "cpu_mean"), "cpu_pct_peak": cpu(c, "cpu_peak"),
                         "rank_rss_gb": c.stat(lambda r: r.typed.cpu_rss_max_rank_gib * 2**30 / 1e9), "status": cell_status(c)})
    tables = []
    gpu_notes = ["From each run's gpu_memory.csv (NVML, nvidia-smi's columns): memory.used over the whole run, start-up included; "
                 "peak = the busiest GPU, mean = mean over GPUs, min = the lowest sample."]
    tables.append(Table("gpu-memory", "GPU memory over the run (nvidia-smi CSV)", GPU_MEM_COLUMNS, gpu_rows, gpu_notes,
                        empty_why="no run has GPU samples: CPU runs, or NVML unavailable"))
    tables.append(Table("cpu-memory", "CPU memory over the run (psrecord-style CSV)", CPU_MEM_COLUMNS, cpu_rows, [
        "From each run's cpu_memory.csv (psutil): RSS and CPU % summed over the launcher, every rank and their children; "
        "shared pages are counted once per process, as psrecord does.",
    ]))
    return tables


# --------------------------------------------------------------------------------------------------
# planner prediction vs measurement


PLAN_COLUMNS = [
    Column("label", "Run", "text"), Column("strategy", "Strategy", "text"), Column("memory", "Memory compared", "text"),
    Column("predicted_gib", "Predicted peak (GiB)", "gib"), Column("measured_gib", "Measured peak (GiB)", "gib"),
    Column("error_pct", "Error %", "pct"), Column("predicted_host_gib", "GPU runs: predicted host (GiB)", "gib"),
    Column("measured_host_gib", "GPU runs: measured host RSS peak (GiB)", "gib"), Column("fits", "Predicted to fit", "text"),
]
GPU_COMPARED = "GPU: torch peak allocated per GPU"
HOST_COMPARED = "host: process-tree RSS, all ranks"


def plan_tables(cells: list[Cell]) -> list[Table]:
    """The plan's prediction against the run's measurement, of the memory the plan predicts for that device:
    GPU memory per GPU on a GPU run, host memory of the whole run on a CPU run (run_plan.py); all in GiB."""
    rows = []
    for c in cells:
        plans = [r.typed.plan for r in c.runs if r.typed.plan is not None]
        if not plans:
            continue
        p = plans[0]
        host = gib_from_gb(cpu(c, "real_peak"))
        if p.gpu_peak_gib is not None:
            compared, predicted, measured = GPU_COMPARED, p.gpu_peak_gib, torch_peak(c)
            extra = {"predicted_host_gib": planned_host_gib(c), "measured_host_gib": host}
        else:
            compared, predicted, measured, extra = HOST_COMPARED, p.cpu_gib, host, {}
        m = med(measured)
        rows.append({"label": c.label, "strategy": c.strategy, "memory": compared, "predicted_gib": predicted, "measured_gib": measured,
                     "error_pct": (predicted - m) / m * 100.0 if predicted is not None and m else None, **extra,
                     "fits": {True: "yes", False: "no"}.get(p.fits, "-" if compared == HOST_COMPARED else "?")})
    if not rows:
        return []
    return [Table("plan", "Memory planner: predicted vs measured peak memory", PLAN_COLUMNS, rows, [
        f"Memory compared: on a GPU run ({GPU_COMPARED!r}) the plan's peak of torch.cuda.max_memory_allocated per GPU against "
        f"the busiest rank's; on a CPU run ({HOST_COMPARED!r}) the plan's host memory of the whole run against the process "
        "tree's peak RSS in cpu_memory.csv (shared pages counted once per process). All figures in GiB (2^30 bytes); "
        "error % = (predicted - measured) / measured. 'Predicted to fit' is a GPU verdict (none on a CPU).",
    ])]


# --------------------------------------------------------------------------------------------------
# a model that does not fit: every offload strategy and optimizer option side by side


BIG_MODEL_COLUMNS = [
    Column("label", "Run", "text"), Column("strategy", "Strategy", "text"), Column("optimizer", "Optimizer arithmetic", "text"),
    Column("batch", "Micro x accum", "text"), Column("tokens_per_step", "Tokens/step", "int"),
    Column("useful_tokens_per_s", "Useful tok/s"), Column("mfu_pct", "MFU %", "pct"),
    Column("gpu_peak_gib", "Peak GPU mem (GiB)", "gib"), Column("predicted_gib", "Predicted GPU (GiB)", "gib"),
    Column("cpu_rss_peak_gb", "Peak host RSS (GB)", "gb"), Column("predicted_cpu_gib", "Predicted host (GiB)", "gib"),
    Column("final_loss", "Loss after N steps"), Column("compute_s", "GPU compute s/step"), Column("optimizer_s", "CPU optimizer s/step"),
    Column("idle_s", "Idle s/step"), Column("transfer_s", "Transfers s/step (est., overlapped)"), Column("status", "Status", "text"),
]


def _split(c: Cell, key: str) -> Spread | None:
    return c.stat(lambda r: getattr(r.typed.time_split, key))  # no time_split: AttributeError, a figure the run lacks


def planned_row(c: Cell) -> dict[str, Any]:
    """``basic_row`` and the run's own plan beside it (summary.json ``plan``: GPU peak, host per node)."""
    row = basic_row(c)
    plan = next((r.typed.plan for r in c.runs if r.typed.plan is not None), None)
    row.update(predicted_gib=plan and plan.gpu_peak_gib, predicted_cpu_gib=planned_host_gib(c))
    return row


def big_model_tables(cells: list[Cell]) -> list[Table]:
    members = [c for c in cells if c.in_part("big-model")]
    tables = []
    for group in group_by(members, lambda c: (c.model, c.world)).values():
        rows = []
        for c in group:
            row = planned_row(c)
            row.update(optimizer=c.first("optimizer", "?"), batch=f"{row['micro_batch']} x {c.first('grad_accum', '?')}",
                       tokens_per_step=c.first("tokens_per_step"), compute_s=_split(c, "gpu_compute_s"),
                       optimizer_s=_split(c, "cpu_optimizer_s"), idle_s=_split(c, "idle_s"), transfer_s=_split(c, "transfer_s"))
            rows.append(row)
        tables.append(Table("big-model", f"A model that does not fit: {where_ran(group[0])}", BIG_MODEL_COLUMNS, rows, [
            "Time split (offload runs, summary.json time_split): GPU compute = forward+backward by CUDA events; CPU optimizer = the "
            "optimizer step's wall time up to a device sync (CPU AdamW + the weight copies it waits for); idle = the rest of the step; "
            "transfers = bytes moved / pinned bandwidth measured at setup, an estimate that overlaps the other parts.",
            "Predicted = `shardlab plan` for that run (GPU: max_memory_allocated; host: the CPU-side states per node).",
        ]))
    return tables


__all__ = ["memory_tables", "plan_tables", "big_model_tables", "planned_row", "GPU_COMPARED", "HOST_COMPARED", "BIG_MODEL_COLUMNS"]
