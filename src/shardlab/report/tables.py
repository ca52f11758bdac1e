"""The seed tutorials' tables, computed from run directories, with the equal-footing rule applied.

Equal footing: two runs are compared (a ratio, a saving, a speed-up) only when they agree on
precision, global batch, sequence length and tokens trained (weak scaling: per-GPU batch and steps
instead of the global batch and tokens). A comparison across runs that differ is still shown, as
the seeds show it, but flagged with what differs, and the equal-footing value stands next to it.

Every figure of a cell is the median over its repeats; ``Spread`` keeps the min-max.

The weak and strong scaling tables are in scaling.py, those of memory (over the run, planned vs measured, a model
that does not fit) in memory.py: both build on this module, and report/__init__.py puts their tables in order.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from ..measure.compile_stats import compared_with_cached_plan
from ..specs.registry import lookup
from .load import Cell, Run, Spread, spread

FOOTING = ("precision", "global_batch", "seq_len", "tokens")
FLAG = "\u26a0"  # warning sign


@dataclass
class Column:
    key: str
    title: str
    kind: str = "num"  # num | int | pct | ratio | text | gib | gb | loss


@dataclass
class Table:
    key: str  # strategies | pin-memory | offload | weak-scaling | strong-scaling | scaling | scaling-memory | gpu-memory | cpu-memory | plan | eval | runs
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    empty_why: str = "no run has data for it"  # said in the report when the table has no rows and is left out

    @property
    def flagged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("flags")]


# --------------------------------------------------------------------------------------------------
# figures of a run / a cell


def _f(row: dict[str, str], *names: str) -> float | None:
    for n in names:
        if row.get(n) not in (None, ""):
            try:
                return float(row[n])
            except ValueError:
                return None
    return None


def gpu_csv_stats(run: Run) -> dict[str, float] | None:
    """nvidia-smi-style CSV -> GiB: the busiest GPU's peak, the mean over GPUs, the lowest minimum, mean utilisation."""
    per: dict[str, list[float]] = {}
    util: list[float] = []
    for row in run.gpu_samples:
        used = _f(row, "memory.used [MiB]", " memory.used [MiB]")
        if used is None:
            continue
        per.setdefault(str(row.get("index", "0")).strip(), []).append(used / 1024)
        u = _f(row, "utilization.gpu [%]", " utilization.gpu [%]")
        if u is not None:
            util.append(u)
    if not per:
        return None
    means = [sum(v) / len(v) for v in per.values()]
    return {"peak": max(max(v) for v in per.values()), "mean": sum(means) / len(means), "min": min(min(v) for v in per.values()),
            "util_mean": sum(util) / len(util) if util else None, "gpus": len(per), "samples": min(len(v) for v in per.values())}


def cpu_csv_stats(run: Run) -> dict[str, float] | None:
    """psrecord-style CSV -> real/virtual GB peak and mean, CPU % mean and peak (after the first sample)."""
    real, virt, cpu = [], [], []
    for i, row in enumerate(run.cpu_samples):
        r = _f(row, "Real (MB)")
        if r is None:
            continue
        real.append(r / 1e3)
        virt.append((_f(row, "Virtual (MB)") or 0) / 1e3)
        if i:
            cpu.append(_f(row, "CPU (%)") or 0.0)
    if not real:
        return None
    return {"real_peak": max(real), "real_mean": sum(real) / len(real), "virtual_peak": max(virt),
            "cpu_mean": sum(cpu) / len(cpu) if cpu else None, "cpu_peak": max(cpu) if cpu else None, "samples": len(real)}


def tokens(c: Cell) -> Spread | None:
    return c.stat("useful_tokens_per_s")


def epoch_time(c: Cell) -> Spread | None:
    return c.stat("epoch_time_projected_s")


def torch_peak(c: Cell) -> Spread | None:
    return c.stat("gpu_mem_peak_gib")


def gpu_monitor_stats(run: Run) -> dict[str, float] | None:
    """The run monitor's NVML figures (summary.json gpu_monitor) in GiB, as gpu_csv_stats computes them from the CSV."""
    g = run.typed.gpu_monitor
    if g is None or not g.sampled:
        return None
    used, util = g.memory_used_mib, g.utilization_pct
    return {"peak": used.peak / 1024, "mean": used.mean / 1024, "min": used.min / 1024,
            "util_mean": util.mean if util is not None else None, "gpus": len(g.gpus or []), "samples": g.samples}


def cpu_monitor_stats(run: Run) -> dict[str, float] | None:
    """The run monitor's process-tree figures (summary.json cpu_monitor) in GB, as cpu_csv_stats computes them."""
    m = run.typed.cpu_monitor
    if m is None or not m.sampled:
        return None
    real, virt, pct = m.real_mb, m.virtual_mb, m.cpu_pct
    return {"real_peak": real.peak / 1e3, "real_mean": real.mean / 1e3,
            "virtual_peak": virt.peak / 1e3 if virt is not None and virt.peak is not None else 0.0,
            "cpu_mean": pct.mean if pct is not None else None, "cpu_peak": pct.peak if pct is not None else None,
            "samples": m.samples}


def nvml(c: Cell, what: str) -> Spread | None:
    return c.stat(lambda r: (gpu_monitor_stats(r) or {})[what])


def cpu(c: Cell, what: str) -> Spread | None:
    return c.stat(lambda r: (cpu_monitor_stats(r) or {})[what])


def planned_host_gib(c: Cell) -> float | None:
    """The plan's host memory per node for a cell, each run against the figure for its own compile: a run that found
    every compiled graph in inductor's cache (its workers compiled nothing) against ``plan.cpu_gib_cached``, any other
    against ``plan.cpu_gib``; the median over the runs."""
    planned = []
    for r in c.runs:
        p = r.typed.plan
        if p is None or p.cpu_gib is None:
            continue
        planned.append(p.cpu_gib_cached if compared_with_cached_plan(p.cpu_gib_cached, r.typed.compile_cache) else p.cpu_gib)
    return statistics.median(planned) if planned else None


def med(s: Spread | None) -> float | None:
    return s.median if s is not None else None


def ratio(a: Spread | None, b: Spread | None) -> float | None:
    if a is None or b is None or not b.median:
        return None
    return a.median / b.median


def pct_change(new: Spread | None, old: Spread | None) -> float | None:
    r = ratio(new, old)
    return None if r is None else (r - 1.0) * 100.0

def gib_from_gb(s: Spread | None) -> Spread | None:
    """A Spread of GB (10^9 bytes: psrecord's and cpu_memory.csv's unit) in GiB (2^30 bytes: the planner's)."""
    k = 1e9 / 2**30
    return None if s is None else Spread(s.median * k, s.low * k, s.high * k, s.n)



def differences(a: Cell, b: Cell, keys: tuple[str, ...] = FOOTING) -> list[str]:
    fa, fb = a.footing(), b.footing()
    return [f"{k} {fa.get(k)} vs {fb.get(k)}" for k in keys if fa.get(k) != fb.get(k)]


def cell_status(c: Cell) -> str:
    if c.ok:
        failed = [f for f in c.failures if f.get("status") == "failed"]
        return "ok" if not failed else f"ok ({len(c.runs)} of {c.repeats} repeats; {failed[0].get('reason')})"
    f = next((f for f in c.failures if f.get("status") == "failed"), c.failures[0] if c.failures else {})
    kind = f.get("kind")
    return f"FAILED{f' ({kind})' if kind else ''}: {f.get('reason', 'unknown')}"


def config_key(c: Cell, drop: tuple[str, ...]) -> str:
    def strip(node: Any, prefix: str = "") -> Any:
        if isinstance(node, dict):
            return {k: strip(v, f"{prefix}{k}.") for k, v in node.items() if f"{prefix}{k}" not in drop}
        return node

    return yaml.safe_dump(strip(c.config), sort_keys=True)


IGNORED = ("output_dir", "resume", "monitor_interval_s", "log_every", "seed", "tensorboard", "wandb", "wandb_project")
BATCH = ("micro_batch", "grad_accum", "global_batch")


def group_by(cells: list[Cell], key: Callable[[Cell], Any]) -> dict[Any, list[Cell]]:
    out: dict[Any, list[Cell]] = {}
    for c in cells:
        out.setdefault(key(c), []).append(c)
    return out


def where_ran(c: Cell) -> str:
    unit = "GPU" if c.device_type == "cuda" else "process"
    plural = ("es" if unit == "process" else "s") if c.world != 1 else ""
    return f"{c.model}, {c.world} {unit}{plural}" + (" (CPU)" if c.device_type == "cpu" else "")


# --------------------------------------------------------------------------------------------------
# strategy comparison


STRATEGY_COLUMNS = [
    Column("label", "Run", "text"), Column("strategy", "Strategy", "text"), Column("precision", "Precision", "text"),
    Column("global_batch", "Global batch", "int"), Column("epoch_time_s", "Time/epoch (s)"),
    Column("useful_tokens_per_s", "Useful tok/s"), Column("gpu_peak_gib", "Peak GPU mem (GiB)", "gib"),
    Column("cpu_rss_peak_gb", "Peak CPU RSS (GB)", "gb"), Column("final_loss", "Final loss"),
    Column("eval_loss", "Eval loss"), Column("mfu_pct", "MFU %", "pct"), Column("vs_dp", "Speed vs DP", "ratio"),
    Column("vs_dp_baseline", "DP baseline", "text"), Column("flags", f"{FLAG} Not on equal footing", "text"),
    Column("status", "Status", "text"),
]


def strategy_tables(cells: list[Cell]) -> list[Table]:
    members = [c for c in cells if c.in_part("strategies")]
    tables = []
    for group in group_by(members, lambda c: (c.model, c.world)).values():
        if len(group) < 2:
            continue
        dps = [c for c in group if _engine(c.strategy) == "ddp" and c.ok]
        rows = []
        for c in group:
            row = basic_row(c)
            if c.ok:
                honest = [d for d in dps if not differences(c, d)]
                base = c if c in honest else (honest[0] if honest else None)
                row["vs_dp"] = ratio(tokens(c), tokens(base)) if base else None
                row["vs_dp_baseline"] = base.label if base else ("no DP run on equal footing" if dps else "no DP run")
                flags = []
                for d in dps:
                    diff = differences(c, d)
                    if diff:
                        r = ratio(tokens(c), tokens(d))
                        honest_txt = f"; on equal footing: {row['vs_dp']:.2f}x vs {base.label}" if base and row["vs_dp"] else "; no equal-footing DP run"
                        flags.append(f"{r:.2f}x vs {d.label} ({', '.join(diff)}{honest_txt})" if r else f"vs {d.label}: {', '.join(diff)}")
                row["flags"] = " | ".join(flags)
            rows.append(row)
        t = Table("strategies", f"Strategy comparison: {where_ran(group[0])}", STRATEGY_COLUMNS, rows, [
            "Time/epoch = steps per epoch x median step time (warm-up steps excluded); useful tokens = non-pad tokens.",
            "Peak GPU mem = torch.cuda.max_memory_allocated, the largest over ranks (NVML's figure, with the CUDA context and "
            "allocator cache, is in the GPU memory table).",
            "Speed vs DP = useful tokens/s over those of the DP run with the same precision, global batch, sequence length and tokens.",
        ])
        tables.append(t)
    return tables


def basic_row(c: Cell) -> dict[str, Any]:
    f = c.footing()
    mfu = c.stat("mfu")
    return {
        "label": c.label, "strategy": c.strategy, "precision": f["precision"], "global_batch": f["global_batch"],
        "micro_batch": f["micro_batch"], "seq_len": f["seq_len"], "steps": f["steps"], "gpus": c.world,
        "epoch_time_s": epoch_time(c), "useful_tokens_per_s": tokens(c), "tokens_per_s": c.stat("tokens_per_s"),
        "gpu_peak_gib": torch_peak(c), "cpu_rss_peak_gb": cpu(c, "real_peak"), "final_loss": c.stat("final_train_loss"),
        "eval_loss": c.stat("final_eval_loss"), "mfu_pct": Spread(mfu.median * 100, mfu.low * 100, mfu.high * 100, mfu.n) if mfu else None,
        "flags": "", "status": cell_status(c),
    }


# --------------------------------------------------------------------------------------------------
# pinned vs pageable offload buffers


PIN_COLUMNS = [
    Column("label", "Run", "text"), Column("strategy", "Strategy", "text"), Column("pinned", "Pinned", "text"),
    Column("gpu_peak_gib", "Peak GPU mem (GiB)", "gib"), Column("nvml_peak_gib", "GPU mem used peak (GiB, NVML)", "gib"),
    Column("cpu_rss_peak_gb", "Peak CPU RSS (GB)", "gb"), Column("cpu_rss_mean_gb", "Mean CPU RSS (GB)", "gb"),
    Column("cpu_pct_mean", "Mean CPU %", "num"), Column("useful_tokens_per_s", "Useful tok/s"),
    Column("epoch_time_s", "Time/epoch (s)"), Column("runtime_delta_pct", "Runtime \u0394 % vs pinned", "pct"),
    Column("cpu_rss_delta_pct", "CPU RSS \u0394 % vs pinned", "pct"), Column("flags", f"{FLAG} Not on equal footing", "text"),
    Column("status", "Status", "text"),
]


def pin_tables(cells: list[Cell]) -> list[Table]:
    members = [c for c in cells if c.in_part("pin-memory") and _offloads(c.strategy)]
    # batch keys left out: a failed run's config is unresolved; footing differences are flagged instead
    groups = group_by(members, lambda c: config_key(c, IGNORED + BATCH + ("strategy_options.pin_memory",)))
    rows = []
    for group in groups.values():
        pinned = [c for c in group if c.pinned]
        unpinned = [c for c in group if not c.pinned]
        if not pinned or not unpinned:
            continue
        ref = pinned[0]
        for c in pinned + unpinned:
            row = basic_row(c)
            row.update(pinned="yes" if c.pinned else "no", nvml_peak_gib=nvml(c, "peak"), cpu_rss_mean_gb=cpu(c, "real_mean"),
                       cpu_pct_mean=cpu(c, "cpu_mean"))
            if c is not ref and c.ok and ref.ok:
                row["runtime_delta_pct"] = pct_change(epoch_time(c), epoch_time(ref))
                row["cpu_rss_delta_pct"] = pct_change(cpu(c, "real_peak"), cpu(ref, "real_peak"))
                diff = differences(c, ref)
                row["flags"] = f"vs {ref.label}: {', '.join(diff)}" if diff else ""
            rows.append(row)
    if not rows:
        return []
    return [Table("pin-memory", f"Pinned vs pageable CPU-offload buffers: {where_ran(members[0])}", PIN_COLUMNS, rows, [
        "Runtime \u0394 % = (time/epoch unpinned - pinned) / pinned; CPU RSS summed over the launcher and all ranks (psutil).",
    ])]


# --------------------------------------------------------------------------------------------------
# ZeRO stage with and without offload


OFFLOAD_COLUMNS = [
    Column("label", "Run", "text"), Column("stage", "ZeRO stage", "text"), Column("offload", "Offload", "text"),
    Column("gpu_peak_gib", "Peak GPU mem (GiB)", "gib"), Column("cpu_rss_peak_gb", "Peak CPU RSS (GB)", "gb"),
    Column("epoch_time_s", "Time/epoch (s)"), Column("useful_tokens_per_s", "Useful tok/s"),
    Column("mem_savings_pct", "Mem Savings %", "pct"), Column("runtime_delta_pct", "Runtime \u0394 %", "pct"),
    Column("cpu_rss_delta_pct", "CPU RSS \u0394 %", "pct"), Column("flags", f"{FLAG} Not on equal footing", "text"),
    Column("status", "Status", "text"),
]


def _engine(strategy: str) -> str | None:
    s = lookup(strategy)
    return s.engine if s is not None else None


def _offloads(strategy: str) -> bool:
    s = lookup(strategy)
    return s is not None and s.offloads


def _stage(strategy: str) -> str | None:
    """The offload table's row group: the ZeRO stage ("0".."3") of a DeepSpeed run whose states stay in host RAM or
    on the GPU, "FSDP" for FSDP2; None for the rest (NVMe swap, dp, torchao, pipeline)."""
    s = lookup(strategy)
    if s is None:
        return None
    if s.engine == "deepspeed" and "nvme" not in (s.offload_params, s.offload_optimizer):
        return str(s.zero_stage)
    return "FSDP" if s.engine == "fsdp2" else None


def offload_tables(cells: list[Cell]) -> list[Table]:
    members = [c for c in cells if c.in_part("offload") and _stage(c.strategy) is not None]

    def key(c: Cell) -> str:
        return config_key(c, IGNORED + BATCH + ("strategy", "strategy_options.pin_memory"))

    rows = []
    savings_known = False
    for group in group_by(members, key).values():
        for stage in sorted({_stage(c.strategy) for c in group}):
            plain = [c for c in group if _stage(c.strategy) == stage and not _offloads(c.strategy)]
            off = [c for c in group if _stage(c.strategy) == stage and _offloads(c.strategy)]
            if not plain and not off:
                continue
            ref = plain[0] if plain else None
            for c in plain[:1] + off:
                row = basic_row(c)
                row.update(stage=f"ZeRO-{stage}" if stage.isdigit() else "FSDP",
                           offload="no" if c is ref else ("yes (pinned)" if c.pinned else "yes (pageable)"))
                if c is not ref and ref is not None and c.ok and ref.ok:
                    gpu_old, gpu_new = med(torch_peak(ref)), med(torch_peak(c))
                    if gpu_old and gpu_new is not None:
                        row["mem_savings_pct"] = (gpu_old - gpu_new) / gpu_old * 100.0
                        savings_known = True
                    row["runtime_delta_pct"] = pct_change(epoch_time(c), epoch_time(ref))
                    row["cpu_rss_delta_pct"] = pct_change(cpu(c, "real_peak"), cpu(ref, "real_peak"))
                    diff = differences(c, ref)
                    row["flags"] = f"vs {ref.label}: {', '.join(diff)}" if diff else ""
                elif c is not ref and ref is None:
                    row["flags"] = "no run of this stage without offload to compare with"
                elif c is not ref and c.ok and not ref.ok:
                    row["flags"] = f"no comparison: {ref.label} did not run ({cell_status(ref)})"
                rows.append(row)
    if not rows:
        return []
    notes = ["Mem Savings % = (peak GPU memory without offload - with offload) / without offload, peak = torch max_memory_allocated.",
             "Runtime \u0394 % = (time/epoch with offload - without) / without; CPU RSS \u0394 % likewise for the process tree's peak RSS."]
    if not savings_known:
        notes.append("No GPU memory was measured (CPU runs): Mem Savings % needs GPU runs; the CPU-side cost is in CPU RSS \u0394 %.")
    return [Table("offload", f"ZeRO stage with and without CPU offload: {where_ran(members[0])}", OFFLOAD_COLUMNS, rows, notes)]


# held-out loss: before training, after, the best step, early stopping


EVAL_COLUMNS = [
    Column("label", "Run", "text"), Column("steps", "Steps", "int"), Column("initial_eval_loss", "Eval loss before", "loss"),
    Column("final_eval_loss", "Eval loss after", "loss"), Column("best_eval_loss", "Best eval loss", "loss"), Column("best_step", "Best step", "int"),
    Column("exported_step", "Exported step", "int"), Column("stopped_early", "Stopped early", "text"),
]


def eval_tables(cells: list[Cell]) -> list[Table]:
    rows = []
    for c in cells:
        if not c.ok or (c.first("initial_eval_loss") is None and c.first("best_eval_loss") is None):
            continue
        patience = c.first("early_stopping_patience")
        stopped = "yes" if c.first("stopped_early") else "no"
        rows.append({"label": c.label, "steps": c.stat("steps"), "initial_eval_loss": c.stat("initial_eval_loss"),
                     "final_eval_loss": c.stat("final_eval_loss"), "best_eval_loss": c.stat("best_eval_loss"),
                     "best_step": c.stat("best_step"), "exported_step": c.stat("exported_step"),
                     "stopped_early": f"{stopped} (patience {patience})" if patience else "no early stopping"})
    if not rows:
        return []
    return [Table("eval", "Held-out eval loss: before training, after, and the best step", EVAL_COLUMNS, rows, [
        "Before = the eval before the first step; after = the last eval; best = the lowest eval after a training step.",
        "Exported step = the step in model/: the best one with --save-best, else the last.",
    ])]


# --------------------------------------------------------------------------------------------------
# every cell, failed ones included


RUN_COLUMNS = [
    Column("label", "Run", "text"), Column("model", "Model", "text"), Column("strategy", "Strategy", "text"),
    Column("gpus", "GPUs", "int"), Column("precision", "Precision", "text"), Column("micro_batch", "Micro", "int"),
    Column("global_batch", "Global batch", "int"), Column("seq_len", "Seq", "int"), Column("steps", "Steps", "int"),
    Column("repeats", "Repeats", "text"), Column("useful_tokens_per_s", "Useful tok/s"), Column("tokens_per_s", "All tok/s"),
    Column("mfu_pct", "MFU %", "pct"), Column("status", "Status", "text"),
]


def runs_table(cells: list[Cell]) -> Table:
    rows = []
    for c in cells:
        row = basic_row(c)
        row.update(model=c.model, repeats=f"{len(c.runs)}/{c.repeats}")
        rows.append(row)
    warm = next((w for c in cells if c.ok and (w := c.first("warmup_steps_excluded"))), None)
    short = [c.label for c in cells if any(r.typed.rate_includes_warm_up for r in c.runs)]
    notes = [
        f"Throughput is the median over steps after the first {warm if warm is not None else 3} (warm-up, excluded), "
        "then the median over repeats, min-max in brackets.",
        "Useful tok/s counts non-pad tokens only; all tok/s counts padding too. MFU uses useful tokens "
        "(6N + 12LHQT FLOPs per token, PaLM appendix B) over the GPU's dense peak; none for unknown devices and CPUs.",
    ]
    if short:
        notes.append(f"{FLAG} Too short for a warm-up, so their rate includes it (compilation, allocator growth): "
                     f"{', '.join(short)}.")
    return Table("runs", "All runs", RUN_COLUMNS, rows, notes)


def build_tables(cells: list[Cell], others: tuple[Callable[[list[Cell]], list[Table]], ...] = ()) -> list[Table]:
    """Every table the runs support, in the order of the seed tutorials: this module's own, with ``others`` (the tables
    that modules built on this one make, in their order: report.OTHER_TABLES) between the offload and the eval tables.
    A table without rows is left out; the last table (all runs) says which were left out and why."""
    tables = [*strategy_tables(cells), *pin_tables(cells), *offload_tables(cells), *(t for build in others for t in build(cells)),
              *eval_tables(cells), runs_table(cells)]
    kept = [t for t in tables if t.rows]
    for t in tables:
        if not t.rows and kept:
            kept[-1].notes.append(f"Not shown: {t.title} ({t.empty_why}).")
    return kept


__all__ = ["Table", "Column", "build_tables", "FOOTING", "differences", "gpu_monitor_stats", "cpu_monitor_stats", "gpu_csv_stats",
           "cpu_csv_stats", "spread", "FLAG"]
