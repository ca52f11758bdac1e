"""The report reads right: the planner table names the memory it compares in one unit, plots keep every label
inside the figure and every line in a legend, and an empty table is left out with a note.

Run directories are written here by hand (summary.json, config.yaml, metrics.jsonl, the monitor CSVs), so these
tests train nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardlab.measure.monitor import stats
from shardlab.report import build
from shardlab.report import plots as plots_mod
from shardlab.report.load import Spread
from shardlab.report.memory import GPU_COMPARED, HOST_COMPARED
from shardlab.report.tables import Table

LONG = "zero3_offload-pinned-gpt2-medium-micro-batch-16-seq-1024"  # a label as long as a bench's


def _run_dir(path: Path, *, strategy: str, gpu: bool, plan: dict | None, rss_mb: list[float]) -> Path:
    path.mkdir(parents=True)
    summary = {"model": "gpt2-medium", "strategy": strategy, "precision": "bf16", "device_type": "cuda" if gpu else "cpu",
               "world_size": 2, "global_batch": 16, "micro_batch": 8, "seq_len": 1024, "steps": 20,
               "useful_tokens_per_s": 5000.0, "tokens_per_s": 5000.0, "cpu_rss_max_rank_gib": 1.5, "warmup_steps_excluded": 3}
    if gpu:
        summary.update(gpu_mem_peak_gib=20.0, gpu_mem_peak_reserved_gib=22.0)
        rows = ["timestamp,index,name,memory.used [MiB],memory.total [MiB],utilization.gpu [%]"]
        rows += [f"2026/11/21 10:00:0{i}.000,0,NVIDIA H100 80GB HBM3,{u},81559,90" for i, u in enumerate([512, 20_000, 24_576])]
        (path / "gpu_memory.csv").write_text("\n".join(rows) + "\n")
        used = stats([512.0, 20_000.0, 24_576.0])  # what the run's monitor put into summary.json for that CSV
        summary["gpu_monitor"] = {"available": True, "samples": 3, "memory_used_mib": used, "utilization_pct": stats([90.0] * 3),
                                  "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_used_mib": used}]}
    if plan is not None:
        summary["plan"] = plan
    summary["cpu_monitor"] = {"available": True, "samples": len(rss_mb), "max_processes": 3, "real_mb": stats(rss_mb),
                              "virtual_mb": stats([2 * mb for mb in rss_mb]), "cpu_pct": stats([100.0] * (len(rss_mb) - 1))}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "config.yaml").write_text(yaml.safe_dump({"model": "gpt2-medium", "strategy": strategy, "gpus": 2, "seq_len": 1024}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s}) + "\n" for s in range(1, 21)))
    csv_rows = ["Elapsed time,CPU (%),Real (MB),Virtual (MB),Processes"] + [f"{i * 0.5},100,{mb},{2 * mb},3" for i, mb in enumerate(rss_mb)]
    (path / "cpu_memory.csv").write_text("\n".join(csv_rows) + "\n")
    return path


def test_planner_table_compares_gpu_memory_on_gpus_and_host_memory_on_cpus_in_gib(tmp_path):
    gpu_plan = {"gpu_peak_gib": 22.0, "cpu_gib": 30.0, "fits": True, "strategy": "zero2"}
    cpu_plan = {"gpu_peak_gib": None, "cpu_gib": 4.0, "fits": None, "strategy": "dp"}
    gpu_run = _run_dir(tmp_path / "on-gpu", strategy="zero2", gpu=True, plan=gpu_plan, rss_mb=[1000.0, 32_212.25])
    cpu_run = _run_dir(tmp_path / "on-cpu", strategy="dp", gpu=False, plan=cpu_plan, rss_mb=[1000.0, 4294.967296])
    _, tables, _, _ = build([gpu_run, cpu_run])
    (plan,) = [t for t in tables if t.key == "plan"]
    rows = {r["label"]: r for r in plan.rows}
    g, c = rows["on-gpu"], rows["on-cpu"]
    assert g["memory"] == GPU_COMPARED and g["predicted_gib"] == 22.0 and g["measured_gib"].median == 20.0
    assert g["error_pct"] == pytest.approx(10.0)
    assert g["measured_host_gib"].median == pytest.approx(32_212.25e6 / 2**30)  # cpu_memory.csv's MB shown in GiB
    assert c["memory"] == HOST_COMPARED and c["predicted_gib"] == 4.0
    assert c["measured_gib"].median == pytest.approx(4.0) and c["error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert "measured_host_gib" not in c and c["fits"] == "-"
    units = {col.title.split("(")[-1] for col in plan.columns if col.kind in ("gib", "gb")}
    assert units == {"GiB)"}, units  # one unit in the whole table
    assert "on a CPU run" in plan.notes[0] and "All figures in GiB" in plan.notes[0]


def test_an_empty_table_is_left_out_with_a_note(tmp_path):
    run = _run_dir(tmp_path / "cpu-only", strategy="dp", gpu=False, plan=None, rss_mb=[900.0, 1000.0])
    _, tables, _, _ = build([run])
    assert all(t.rows for t in tables)
    assert "gpu-memory" not in {t.key for t in tables}
    assert any(n == "Not shown: GPU memory over the run (nvidia-smi CSV) (no run has GPU samples: CPU runs, or NVML unavailable)."
               for n in tables[-1].notes), tables[-1].notes


@pytest.fixture
def figures(monkeypatch):
    """Every figure the plot functions render, kept (after drawing) for inspection."""
    seen = []
    render = plots_mod.png_bytes

    def keep(fig):
        png = render(fig)  # draws the figure: text positions are final
        seen.append(fig)
        return png

    monkeypatch.setattr(plots_mod, "png_bytes", keep)
    return seen


def _check(fig) -> None:
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        # everything the axes draws: title, axis labels, the tick labels in view, its legend
        ext = ax.get_tightbbox(renderer)
        assert ext.x0 >= box.x0 - 1 and ext.y0 >= box.y0 - 1 and ext.x1 <= box.x1 + 1 and ext.y1 <= box.y1 + 1, \
            f"a label of {ax.get_title()!r} is cut: {ext} reaches outside the figure {box}"
    in_legend = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label() == "_nolegend_":  # error-bar caps and the like: part of another artist
                continue
            assert line.get_label() in in_legend, f"line {line.get_label()!r} of {ax.get_title()!r} is in no legend ({in_legend})"


def test_plots_keep_labels_inside_and_every_line_in_a_legend(tmp_path, figures):
    runs = [_run_dir(tmp_path / f"{LONG}-{i}", strategy=s, gpu=gpu, plan=None, rss_mb=[800.0, 1200.0, 1100.0])
            for i, (s, gpu) in enumerate([("zero2", True), ("zero3_offload", True), ("dp", False)])]
    cells, tables, plots, _ = build(runs)
    weak = Table("weak-scaling", "Weak scaling (per-GPU batch fixed): gpt2-medium, zero2", [],
                 [{"gpus": g, "samples_per_s": Spread(v, v, v, 1), "efficiency_pct": e} for g, v, e in [(1, 10.0, 100.0), (2, 19.0, 95.0), (4, 36.0, 90.0)]])
    assert plots_mod.scaling_plot([weak]) is not None
    assert plots_mod.memory_plot([c for c in cells if c.device_type == "cpu"]) is not None  # the memory plot's CPU variant
    names = {p.name for p in plots}
    assert {"memory", "throughput", "loss", "gpu_memory_time", "cpu_memory_time"} <= names
    assert len(figures) == len(plots) + 2
    for fig in figures:
        _check(fig)


def test_the_check_catches_a_cut_label_and_a_line_without_legend(figures):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2), dpi=100)  # no constrained layout: long rotated tick labels run off the bottom
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], label="in legend")
    ax.plot([0, 1], [1, 0])
    ax.set_xticks([0, 1], [LONG, LONG], rotation=30, ha="right")
    ax.legend()
    plots_mod.png_bytes(fig)
    with pytest.raises(AssertionError, match="is cut: "):
        _check(fig)
    fig = Figure(figsize=(4, 3), dpi=100, layout="constrained")  # labels fit; one line has no legend entry
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], label="in legend")
    ax.plot([0, 1], [1, 0])
    ax.legend()
    plots_mod.png_bytes(fig)
    with pytest.raises(AssertionError, match="is in no legend"):
        _check(fig)


def test_runs_too_short_for_a_warm_up_are_named_in_the_runs_tables_notes(tmp_path):
    """A run of the warm-up's length or shorter times every step, compile included: the runs table names such cells
    instead of saying "after the first 0" of them; a report of long runs only says nothing of it."""
    from shardlab.report.load import Cell, Run
    from shardlab.report.tables import runs_table

    def cell(label: str, excluded: int) -> Cell:
        summary = {"warmup_steps_excluded": excluded, "useful_tokens_per_s": 1000.0, "steps": 3 + excluded, "timed_steps": 3}
        return Cell(label, {}, runs=[Run(tmp_path / label, summary, {})])

    notes = runs_table([cell("long", 3), cell("short", 0)]).notes
    assert notes[0].startswith("Throughput is the median over steps after the first 3 (warm-up, excluded)")
    assert any("Too short for a warm-up" in n and n.endswith(": short.") for n in notes), notes
    assert not any("Too short" in n for n in runs_table([cell("long", 3)]).notes)
