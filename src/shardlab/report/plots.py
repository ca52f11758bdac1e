"""matplotlib figures of a report: memory per run (stacked where the split is measured), throughput,
loss curves, GPU and CPU memory over time, scaling curves. Each returns PNG bytes (or None when the
runs hold no data for it), so the HTML page can embed them and the report folder can keep them."""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from datetime import datetime

from .load import Cell
from .tables import Table, cpu, gpu_monitor_stats, med, nvml, tokens, torch_peak

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]


@dataclass
class Plot:
    name: str
    title: str
    png: bytes
    caption: str


def new_figure(width: float = 8.0, height: float = 4.2):
    from matplotlib.figure import Figure  # matplotlib loads only when a report draws (report tables need none)

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _run_ticks(ax, labels: list[str]) -> None:
    """One tick per run, its label wrapped at hyphens: a bench's labels (40+ characters) rotated in one line run
    past the figure's left edge, more than constrained layout can make room for."""
    wrapped = [textwrap.fill(label, 22, break_on_hyphens=True) for label in labels]
    ax.set_xticks(range(len(labels)), wrapped, rotation=30, ha="right", rotation_mode="anchor", fontsize=8)


def png_bytes(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # as new_figure's

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def memory_plot(cells: list[Cell]) -> Plot | None:
    ok = [c for c in cells if c.ok]
    if not ok:
        return None
    fig = new_figure(max(6.0, 0.7 * len(ok) + 2), 4.4)
    ax = fig.add_subplot()
    labels = [c.label for c in ok]
    x = range(len(ok))
    if any(med(torch_peak(c)) is not None for c in ok):
        alloc = [med(torch_peak(c)) or 0.0 for c in ok]
        reserved = [max(0.0, (med(c.stat("gpu_mem_peak_reserved_gib")) or a) - a) for c, a in zip(ok, alloc)]
        other = []
        for c, a, r in zip(ok, alloc, reserved):
            used = med(nvml(c, "peak"))
            other.append(max(0.0, used - a - r) if used is not None else 0.0)
        ax.bar(x, alloc, color=COLORS[0], label="torch peak allocated")
        ax.bar(x, reserved, bottom=alloc, color=COLORS[1], label="allocator cache (peak reserved - allocated)")
        ax.bar(x, other, bottom=[a + r for a, r in zip(alloc, reserved)], color=COLORS[7],
               label="outside torch (NVML used - reserved: CUDA context, NCCL)")
        ax.set_ylabel("GiB per GPU (busiest rank)")
        title = "Peak GPU memory per run"
        caption = ("Stacked where the split is measured: torch's peak allocated, the caching allocator's extra reserve, and what "
                   "NVML sees beyond torch (CUDA context, NCCL buffers).")
    else:
        rss = [med(cpu(c, "real_peak")) or 0.0 for c in ok]
        rank = [(med(c.stat("cpu_rss_max_rank_gib")) or 0.0) * 2**30 / 1e9 for c in ok]
        ax.bar(x, rss, color=COLORS[2], label="process tree RSS peak (launcher + all ranks)")
        ax.plot(list(x), rank, "o", color=COLORS[3], label="largest single rank RSS")
        ax.set_ylabel("GB")
        title = "Peak CPU memory per run (no GPU was used)"
        caption = "CPU runs have no GPU memory; the process tree's peak RSS (psutil) and the largest rank's RSS are shown."
    _run_ticks(ax, labels)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return Plot("memory", title, png_bytes(fig), caption)


def throughput_plot(cells: list[Cell]) -> Plot | None:
    ok = [c for c in cells if c.ok and tokens(c) is not None]
    if not ok:
        return None
    fig = new_figure(max(6.0, 0.7 * len(ok) + 2), 4.2)
    ax = fig.add_subplot()
    precisions = sorted({str(c.footing()["precision"]) for c in ok})
    color = {p: COLORS[i % len(COLORS)] for i, p in enumerate(precisions)}
    for i, c in enumerate(ok):
        s = tokens(c)
        ax.bar(i, s.median, color=color[str(c.footing()["precision"])],
               yerr=[[s.median - s.low], [s.high - s.median]] if s.n > 1 else None, capsize=3)
    _run_ticks(ax, [c.label for c in ok])
    for p in precisions:
        ax.bar([0], [0], color=color[p], label=p)
    ax.legend(title="precision", fontsize=8)
    ax.set_ylabel("useful tokens/s (median)")  # longer, it ran off a figure whose axes the tick labels shrink
    ax.set_title("Throughput per run")
    return Plot("throughput", "Throughput per run", png_bytes(fig),
                "Median useful tokens/s; error bars: min-max over repeats. Bars are coloured by precision: runs of different "
                "colours are not on equal footing.")


def loss_plot(cells: list[Cell]) -> Plot | None:
    series = []
    for c in cells:
        if c.ok:
            rows = [r for r in c.runs[0].metrics if "loss" in r and "step" in r]
            if rows:
                series.append((c.label, [r["step"] for r in rows], [r["loss"] for r in rows]))
    if not series:
        return None
    fig = new_figure()
    ax = fig.add_subplot()
    for i, (label, steps, losses) in enumerate(series):
        ax.plot(steps, losses, label=label, color=COLORS[i % len(COLORS)], linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Loss curves (first repeat of each run)")
    return Plot("loss", "Loss curves", png_bytes(fig), "Strategies that only move memory around should trace the same curve.")


def _gpu_timeline(cell: Cell) -> tuple[list[float], list[float]]:
    by_time: dict[str, float] = {}
    for row in cell.runs[0].gpu_samples:
        try:
            used = float(row["memory.used [MiB]"]) / 1024
        except (KeyError, ValueError):
            continue
        by_time[row["timestamp"]] = max(by_time.get(row["timestamp"], 0.0), used)
    if not by_time:
        return [], []
    stamps = sorted(by_time)
    try:
        t = [datetime.strptime(s.strip(), "%Y/%m/%d %H:%M:%S.%f") for s in stamps]
        t0 = t[0]
        xs = [(ti - t0).total_seconds() for ti in t]
    except ValueError:
        xs = [float(i) for i in range(len(stamps))]
    return xs, [by_time[s] for s in stamps]


def _timeline_figure(data: list[tuple[str, list[float], list[float]]], xlabel: str, ylabel: str, title: str):
    """One line per run (label, xs, ys) over time."""
    fig = new_figure()
    ax = fig.add_subplot()
    for i, (label, xs, ys) in enumerate(data):
        ax.plot(xs, ys, label=label, color=COLORS[i % len(COLORS)], linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title)
    return fig


def gpu_timeline_plot(cells: list[Cell]) -> Plot | None:
    data = [(c.label, *_gpu_timeline(c)) for c in cells if c.ok and any(gpu_monitor_stats(r) for r in c.runs)]
    data = [d for d in data if d[1]]
    if not data:
        return None
    fig = _timeline_figure(data, "seconds since the run started", "memory.used, busiest GPU (GiB)", "GPU memory over time (NVML)")
    return Plot("gpu_memory_time", "GPU memory over time", png_bytes(fig), "From gpu_memory.csv of the first repeat of each run.")


def cpu_timeline_plot(cells: list[Cell]) -> Plot | None:
    data = []
    for c in cells:
        if c.ok and c.runs[0].cpu_samples:
            xs, ys = [], []
            for row in c.runs[0].cpu_samples:
                try:
                    xs.append(float(row["Elapsed time"]))
                    ys.append(float(row["Real (MB)"]) / 1e3)
                except (KeyError, ValueError):
                    continue
            if xs:
                data.append((c.label, xs, ys))
    if not data:
        return None
    fig = _timeline_figure(data, "seconds since the launcher started", "process tree RSS (GB)",
                           "CPU memory over time (psutil, launcher + all ranks)")
    return Plot("cpu_memory_time", "CPU memory over time", png_bytes(fig), "From cpu_memory.csv of the first repeat of each run.")


def scaling_plot(tables: list[Table]) -> Plot | None:
    scaling = [t for t in tables if t.key in ("weak-scaling", "strong-scaling") and t.rows]
    if not scaling:
        return None
    fig = new_figure(4.2 * len(scaling) + 1, 4.0)
    axes = fig.subplots(1, len(scaling), squeeze=False)[0]
    for ax, t in zip(axes, scaling):
        gpus = [r["gpus"] for r in t.rows]
        sps = [med(r["samples_per_s"]) for r in t.rows]
        ax.plot(gpus, sps, "o-", color=COLORS[0], label="measured samples/s")
        if sps and sps[0]:
            # weak and strong scaling share the ideal: samples/s proportional to the GPU count
            ax.plot(gpus, [sps[0] * g / gpus[0] for g in gpus], "--", color=COLORS[7], label="linear (100% efficiency)")
        ax2 = ax.twinx()
        ax2.plot(gpus, [r.get("efficiency_pct") for r in t.rows], "s:", color=COLORS[3], label="efficiency %")
        ax2.set_ylim(0, 120)
        ax2.set_ylabel("efficiency %")
        ax.set_xlabel("GPUs (processes)")
        ax.set_ylabel("samples/s")
        ax.set_xticks(gpus)
        ax.set_title(t.title.split(":")[0], fontsize=10)
        lines, labels = ax.get_legend_handles_labels()
        twin_lines, twin_labels = ax2.get_legend_handles_labels()  # the efficiency line lives on the twin axis
        ax.legend(lines + twin_lines, labels + twin_labels, fontsize=7, loc="upper left")
    return Plot("scaling", "Scaling", png_bytes(fig), "Samples/s against the GPU count, the linear ideal and the efficiency.")


def weak_scaling_efficiency_plot(tables: list[Table]) -> Plot | None:
    """Efficiency against the GPU count, one line per strategy and mode, one panel per model (per `scaling` table)."""
    scaling = [t for t in tables if t.key == "scaling" and t.rows]
    counts_of = [sorted(int(c.key.split("_")[-1]) for c in t.columns if c.key.startswith("tok_s_")) for t in scaling]
    scaling = [(t, n) for t, n in zip(scaling, counts_of) if len(n) > 1]
    if not scaling:
        return None
    fig = new_figure(4.6 * len(scaling) + 1, 4.2)
    axes = fig.subplots(1, len(scaling), squeeze=False)[0]
    strategies = list(dict.fromkeys(r["strategy"] for t, _ in scaling for r in t.rows))
    color = {s: COLORS[i % len(COLORS)] for i, s in enumerate(strategies)}
    for ax, (t, counts) in zip(axes, scaling):
        ax.axhline(100, color=COLORS[7], linestyle=":", linewidth=1, label="ideal (100%)")
        for r in t.rows:
            points = [(counts[0], 100.0 if med(r.get(f"tok_s_{counts[0]}")) else None)]
            points += [(n, r.get(f"eff_{n}")) for n in counts[1:]]
            points = [(n, e) for n, e in points if e is not None]
            if len(points) < 2:
                continue
            ax.plot([n for n, _ in points], [e for _, e in points], "o-" if r["mode"] == "eager" else "s--",
                    color=color[r["strategy"]], label=f"{r['strategy']} {r['mode']}", linewidth=1.4)
        ax.set_xticks(counts)
        ax.set_xlabel("GPUs" if "GPUs" in t.title else "CPU processes")
        ax.set_ylabel("weak-scaling efficiency %")
        ax.set_ylim(bottom=0)
        ax.set_title(textwrap.fill(t.title.split(": ", 1)[-1], 48), fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    return Plot("weak_scaling_efficiency", "Weak-scaling efficiency", png_bytes(fig),
                "Efficiency = tok/s(N) / (N x tok/s(1)) (medians over repeats) against the GPU count, one line per strategy "
                "(solid: eager, dashed: compiled), one panel per model; 100% = linear scaling.")


def time_split_plot(cells: list[Cell]) -> Plot | None:
    """Stacked bars: where each offload run's step goes (summary.json time_split)."""
    ok = [c for c in cells if c.ok and c.first("time_split")]
    if not ok:
        return None
    fig = new_figure(max(6.0, 0.8 * len(ok) + 2), 4.2)
    ax = fig.add_subplot()
    parts = (("gpu_compute_s", "GPU compute"), ("cpu_optimizer_s", "CPU optimizer"), ("idle_s", "idle"))
    for i, c in enumerate(ok):
        split, bottom = c.first("time_split"), 0.0
        for j, (key, title) in enumerate(parts):
            ax.bar(i, split[key], bottom=bottom, color=COLORS[j % len(COLORS)], label=title if i == 0 else None)
            bottom += split[key]
        if split.get("transfer_s") is not None:
            ax.plot([i - 0.4, i + 0.4], [split["transfer_s"]] * 2, color="black", linewidth=1.5, label="transfers (est.)" if i == 0 else None)
    ax.set_xticks(range(len(ok)), [c.label for c in ok], rotation=30, ha="right")
    ax.set_ylabel("seconds per optimizer step (mean after warm-up)")
    ax.set_title("Where an offload step's time goes")
    ax.legend(fontsize=8)
    return Plot("time-split", "Where an offload step's time goes", png_bytes(fig),
                "Black line: the step's host<->device bytes over the measured pinned bandwidth, an estimate that runs overlapped.")


def all_plots(cells: list[Cell], tables: list[Table]) -> list[Plot]:
    plots = [memory_plot(cells), throughput_plot(cells), loss_plot(cells), gpu_timeline_plot(cells), cpu_timeline_plot(cells),
             scaling_plot(tables), weak_scaling_efficiency_plot(tables), time_split_plot(cells)]
    return [p for p in plots if p is not None]


__all__ = ["Plot", "all_plots", "memory_plot", "throughput_plot", "loss_plot", "gpu_timeline_plot", "cpu_timeline_plot", "scaling_plot",
           "weak_scaling_efficiency_plot", "time_split_plot"]
