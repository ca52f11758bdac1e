"""Scaling tables: the bench's weak- and strong-scaling parts (one table per series of GPU counts), and the `scaling`
suite's weak scaling of every strategy and mode per model, with the plan's peak memory beside the measured one.

Built on tables.py (its equal-footing rule, figures and row helpers); report/__init__.py puts these tables in order.
"""

from __future__ import annotations

from typing import Any

from ..specs.registry import lookup
from .load import Cell, Run, Spread
from .tables import (BATCH, FLAG, FOOTING, IGNORED, Column, Table, basic_row, cell_status, config_key, cpu, differences, gib_from_gb,
                     group_by, med, nvml, planned_host_gib, ratio, tokens, torch_peak)

# Weak scaling's equal footing: the per-GPU batch and the steps stay fixed while the global batch and tokens grow
WEAK_FOOTING = ("precision", "micro_batch", "seq_len", "steps")


# --------------------------------------------------------------------------------------------------
# weak and strong scaling


WEAK_COLUMNS = [
    Column("label", "Run", "text"), Column("gpus", "GPUs", "int"), Column("global_batch", "Global batch", "int"),
    Column("runtime_s", "Runtime (s)"), Column("steps_per_s", "Steps/s"), Column("samples_per_s", "Samples/s"),
    Column("final_loss", "Train loss"), Column("eval_loss", "Eval loss"), Column("eval_samples_per_s", "Eval samples/s"),
    Column("nvml_peak_gib", "Peak GPU mem (GiB)", "gib"), Column("nvml_mean_gib", "Avg GPU mem (GiB)", "gib"),
    Column("cpu_rss_peak_gb", "Peak CPU RSS (GB)", "gb"), Column("speedup", "Speed-up", "ratio"),
    Column("efficiency_pct", "Efficiency %", "pct"), Column("flags", f"{FLAG} Not on equal footing", "text"),
    Column("status", "Status", "text"),
]


def _last_eval_speed(r: Run) -> float | None:
    for e in reversed(r.typed.epochs or []):
        if e.get("eval_samples_per_s"):
            return e["eval_samples_per_s"]
    for row in reversed(r.metrics):
        if row.get("eval_samples_per_s"):
            return row["eval_samples_per_s"]
    return None


def scaling_tables(cells: list[Cell]) -> list[Table]:
    tables = []
    for kind in ("weak", "strong"):
        part = f"{kind}-scaling"
        members = [c for c in cells if c.ok and c.in_part(part)]
        by_config = group_by(members, lambda c: config_key(c, IGNORED + BATCH + ("gpus", "nodes")))
        for group in by_config.values():
            series_key = (lambda c: c.footing()["micro_batch"]) if kind == "weak" else (lambda c: c.footing()["global_batch"])
            for series in group_by(group, series_key).values():
                if len({c.world for c in series}) < 2:
                    continue
                series.sort(key=lambda c: c.world)
                ref = series[0]
                keys = WEAK_FOOTING if kind == "weak" else FOOTING
                rows = []
                for c in series:
                    row = basic_row(c)
                    sps = c.stat("samples_per_s")
                    row.update(runtime_s=c.stat("total_time_s"), steps_per_s=c.stat("steps_per_s"), samples_per_s=sps,
                               eval_samples_per_s=c.stat(_last_eval_speed), nvml_peak_gib=nvml(c, "peak"),
                               nvml_mean_gib=nvml(c, "mean"))
                    sp = ratio(sps, ref.stat("samples_per_s"))
                    row["speedup"] = sp
                    row["efficiency_pct"] = sp / (c.world / ref.world) * 100.0 if sp else None
                    diff = differences(c, ref, keys)
                    row["flags"] = f"vs {ref.label}: {', '.join(diff)}" if diff else ""
                    rows.append(row)
                what = "per-GPU batch fixed, global batch grows" if kind == "weak" else "global batch fixed"
                tables.append(Table(part, f"{kind.capitalize()} scaling ({what}): {ref.model}, {ref.strategy}", WEAK_COLUMNS, rows, [
                    f"Efficiency = (samples/s / GPUs) / (samples/s / GPUs at {ref.world}); speed-up = samples/s over those at {ref.world}.",
                    "Runtime = the training loop's wall time (evaluations included, start-up excluded). GPU memory from NVML "
                    "(memory.used over the whole run, the busiest GPU's peak and the mean over GPUs).",
                ]))
    return tables


# --------------------------------------------------------------------------------------------------
# weak scaling of every strategy and mode, per model (the `scaling` suite)


SCALING_PART = "scaling"


def mode(c: Cell) -> str:
    return "compiled" if c.setting("compile") else "eager"


def _per_gpu_batch(c: Cell) -> tuple[Any, Any]:
    """(micro, accum) per GPU: what weak scaling holds fixed while the global batch grows with the GPUs."""
    accum = c.first("grad_accum", c.setting("grad_accum"))
    if accum is None and c.setting("global_batch") is None:
        accum = 1
    return c.footing()["micro_batch"], accum


def _weak_group(c: Cell) -> tuple:
    """Runs one efficiency may compare: the same model, precision, sequence, per-GPU batch and everything else, but
    the GPU count (the columns), the strategy and the mode (the rows) and the batch triple's global batch."""
    return (c.model, *_per_gpu_batch(c), config_key(c, IGNORED + BATCH + ("gpus", "nodes", "strategy", "compile")))


def _order(strategy: str) -> int:
    s = lookup(strategy)
    return s.order if s is not None else 10**6


def _mfu_pct(c: Cell) -> Spread | None:
    m = c.stat("mfu")
    return Spread(m.median * 100, m.low * 100, m.high * 100, m.n) if m else None


def _rows_of(group: list[Cell]) -> tuple[list[int], dict[tuple[str, str], dict[int, Cell]]]:
    counts = sorted({c.world for c in group})
    rows: dict[tuple[str, str], dict[int, Cell]] = {}
    for c in sorted(group, key=lambda c: (_order(c.strategy), c.strategy, mode(c) != "eager", c.world)):
        rows.setdefault((c.strategy, mode(c)), {}).setdefault(c.world, c)
    return counts, rows


def weak_efficiency(c: Cell, base: Cell | None) -> tuple[float | None, str]:
    """Weak-scaling efficiency of ``c`` against ``base`` (the same row at the smallest GPU count), in %:
    tok/s(N) / (N / N0 x tok/s(N0)), medians over repeats; None, and why, when the two are not on equal footing."""
    if base is None:
        return None, "no run at the smallest GPU count to compare with"
    if not base.ok:
        return None, f"{base.label} did not run: nothing to compare with"
    if not c.ok:
        return None, ""
    diff = differences(c, base, WEAK_FOOTING)
    if diff:
        return None, f"vs {base.label}: {', '.join(diff)}: not compared"
    t, t0 = med(tokens(c)), med(tokens(base))
    if not t or not t0:
        return None, ""
    return t / (c.world / base.world * t0) * 100.0, ""


def _scaling_title(c: Cell, what: str) -> str:
    f = c.footing()
    units, one = ("GPUs", "GPU") if c.device_type == "cuda" else ("CPU processes", "process")
    micro, accum = _per_gpu_batch(c)
    batch = f"micro {micro}" + (f" x accum {accum}" if accum not in (None, 1) else "")
    return f"{what}, 1 \u2192 N {units}: {c.model} ({f['precision']}, seq {f['seq_len']}, {batch} per {one}, {f['steps']} steps)"


def weak_scaling_tables(cells: list[Cell]) -> list[Table]:
    """Per model (and footing): one row per strategy and mode, tok/s at each GPU count, the efficiency against the
    smallest count and MFU; then the planner's per-GPU and per-node peaks beside the measured ones."""
    members = [c for c in cells if c.in_part(SCALING_PART)]
    tables = []
    for group in group_by(members, _weak_group).values():
        counts, rows = _rows_of(group)
        if len(counts) < 2 and not any(c.parts for c in group):  # loose run dirs: a table only where they scale
            continue
        ref = next((c for c in group if c.ok), group[0])
        unit = "GPU" if ref.device_type == "cuda" else "proc"
        n0 = counts[0]
        columns = [Column("strategy", "Strategy", "text"), Column("mode", "Mode", "text")]
        columns += [Column(f"tok_s_{n}", f"Useful tok/s, {n} {unit}") for n in counts]
        columns += [Column(f"eff_{n}", f"Efficiency % at {n}", "pct") for n in counts[1:]]
        columns += [Column(f"mfu_{n}", f"MFU % at {n}", "pct") for n in counts]
        columns += [Column("repeats", "Repeats", "text"), Column("flags", f"{FLAG} Not compared", "text"), Column("status", "Status", "text")]
        table_rows = []
        for (strategy, how), by_n in rows.items():
            base = by_n.get(n0)
            row: dict[str, Any] = {"strategy": strategy, "mode": how}
            flags, status = [], []
            for n in counts:
                c = by_n.get(n)
                if c is None:
                    continue
                row[f"tok_s_{n}"], row[f"mfu_{n}"] = tokens(c), _mfu_pct(c)
                if n != n0:
                    row[f"eff_{n}"], why = weak_efficiency(c, base)
                    if why:
                        flags.append(f"{n}: {why}")
                if cell_status(c) != "ok":
                    status.append(f"{n} {unit}: {cell_status(c)}")
            row["repeats"] = ", ".join(f"{len(by_n[n].runs)}/{by_n[n].planned or by_n[n].repeats}" for n in counts if n in by_n)
            row["flags"] = " | ".join(flags)
            row["status"] = " | ".join(status) or "ok"
            table_rows.append(row)
        tables.append(Table("scaling", _scaling_title(ref, "Weak scaling"), columns, table_rows, [
            f"Efficiency % at N = tok/s(N) / (N / {n0} x tok/s({n0})) x 100: the medians of useful tokens/s over repeats, each "
            f"against the same strategy and mode at {n0} {unit}; only runs of the same precision, sequence length, per-{unit} "
            "micro-batch and steps are compared (else \u26a0, no efficiency).",
            "Useful tok/s: all ranks together, median over repeats (min-max in brackets), warm-up steps excluded. MFU: per device "
            "against its dense peak (none on CPUs). Repeats: finished of planned, at each count in order.",
        ]))
        tables.append(_scaling_memory_table(ref, counts, rows))
    return tables


SCALING_MEMORY_COLUMNS = [
    Column("label", "Run", "text"), Column("strategy", "Strategy", "text"), Column("mode", "Mode", "text"), Column("gpus", "GPUs (processes)", "int"),
    Column("predicted_gib", "Predicted GPU peak per GPU (GiB)", "gib"), Column("measured_gib", "Measured GPU peak per GPU (GiB)", "gib"),
    Column("error_pct", "GPU error %", "pct"), Column("predicted_host_gib", "Predicted host per node (GiB)", "gib"),
    Column("measured_host_gib", "Measured host RSS per node (GiB)", "gib"), Column("host_error_pct", "Host error %", "pct"),
    Column("status", "Status", "text"),
]


def _error_pct(predicted: float | None, measured: Spread | None) -> float | None:
    m = med(measured)
    return (predicted - m) / m * 100.0 if predicted is not None and m else None


def _scaling_memory_table(ref: Cell, counts: list[int], rows: dict[tuple[str, str], dict[int, Cell]]) -> Table:
    out = []
    for (strategy, how), by_n in rows.items():
        for n in counts:
            c = by_n.get(n)
            if c is None:
                continue
            plan = next((r.typed.plan for r in c.runs if r.typed.plan is not None), None)
            gpu_pred = plan.gpu_peak_gib if plan else None
            host_pred = planned_host_gib(c)
            gpu_meas, host_meas = torch_peak(c), gib_from_gb(cpu(c, "real_peak"))
            out.append({"strategy": strategy, "mode": how, "gpus": n, "label": c.label, "predicted_gib": gpu_pred, "measured_gib": gpu_meas,
                        "error_pct": _error_pct(gpu_pred, gpu_meas), "predicted_host_gib": host_pred, "measured_host_gib": host_meas,
                        "host_error_pct": _error_pct(host_pred, host_meas), "status": cell_status(c)})
    return Table("scaling-memory", _scaling_title(ref, "Weak scaling, planned vs measured peak memory"), SCALING_MEMORY_COLUMNS, out, [
        "Predicted = the run's own plan (summary.json `plan`, made by `shardlab train` before it started); GPU peak = torch "
        "max_memory_allocated per GPU, the busiest rank's; host = the process tree's peak RSS on the node (launcher and every "
        "rank; on a CPU run the plan's host figure is the whole run); a --compile run that found every graph in inductor's "
        "cache is compared with the plan's figure for that (its compile workers compile nothing: `plan.cpu_gib_cached`). GiB = 2^30 bytes; error % = (predicted - measured) / measured, "
        "on the median over repeats.",
    ])


__all__ = ["scaling_tables", "weak_scaling_tables", "weak_efficiency", "mode", "WEAK_FOOTING"]
