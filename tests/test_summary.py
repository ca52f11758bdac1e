"""RunSummary (summary.py): summary.json typed, one writer, tolerant reading; the report's monitor figures from it."""

import ast
import json
import shutil
from pathlib import Path

import pytest

from shardlab.report import build
from shardlab.report.load import read_run
from shardlab.report.render import to_markdown
from shardlab.report.tables import cpu_csv_stats, cpu_monitor_stats, gpu_csv_stats, gpu_monitor_stats
from shardlab.measure.summary import CpuMonitor, GpuMonitor, PlanRecord, RunSummary, TimeSplit, merge_monitor

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# committed runs: one with its monitor CSVs (GPU, 4 ranks, offload time split), one CPU run without them
GPU_RUN = RESULTS / "2026-11-24-h100-big-model" / "big-model-3b" / "runs" / "zero2_offload" / "r1"
CPU_RUN = RESULTS / "2026-11-25-cpu-demo"


def committed_summaries() -> list[Path]:
    return sorted(RESULTS.rglob("summary.json"))


def test_every_committed_summary_round_trips_unchanged():
    paths = committed_summaries()
    assert len(paths) >= 10
    for path in paths:
        text = path.read_text()
        s = RunSummary.read(path.parent)
        assert s.to_dict() == json.loads(text), path
        assert list(s.to_dict()) == list(json.loads(text)), path  # key order kept too
        assert json.dumps(s.to_dict(), indent=1) == json.dumps(json.loads(text), indent=1)


def test_a_real_summary_is_typed(tmp_path):
    s = RunSummary.read(GPU_RUN)
    assert s.strategy == "zero2_offload" and s.device_type == "cuda" and s.world_size >= 1
    assert isinstance(s.time_split, TimeSplit) and s.time_split.gpu_compute_s > 0
    assert isinstance(s.plan, PlanRecord) and s.plan.strategy == "zero2_offload"
    assert isinstance(s.gpu_monitor, GpuMonitor) and s.gpu_monitor.sampled and s.gpu_monitor.gpus[0].memory_used_mib.peak > 0
    assert isinstance(s.cpu_monitor, CpuMonitor) and s.cpu_monitor.real_mb.peak > 0
    assert s.extras == {}  # every key of a current summary has a field
    shutil.copy(GPU_RUN / "summary.json", tmp_path / "summary.json")
    s.write(tmp_path)  # the writer gives back the same file
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((GPU_RUN / "summary.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temporary file left


def test_older_and_newer_files_are_read_tolerantly(tmp_path):
    older = {"model": "tiny-gpt2", "strategy": "dp", "steps": 3, "cpu_monitor": {"available": True, "real_mb": {"peak": 5.0}}}
    (tmp_path / "summary.json").write_text(json.dumps(older))
    s = RunSummary.read(tmp_path)
    assert s.steps == 3 and s.useful_tokens_per_s is None and s.gpu_monitor is None and s.time_split is None
    assert s.cpu_monitor.real_mb.peak == 5.0 and s.cpu_monitor.real_mb.mean is None and s.cpu_monitor.samples is None
    assert s.to_dict() == older  # missing fields are not invented on the way back
    newer = {**older, "pipeline": {"stages": 2}, "a_future_key": [1, 2], "plan": {"strategy": "dp", "new_plan_key": 1}}
    (tmp_path / "summary.json").write_text(json.dumps(newer))
    s = RunSummary.read(tmp_path)
    assert s.extras == {"pipeline": {"stages": 2}, "a_future_key": [1, 2]} and s.plan.extras == {"new_plan_key": 1}
    s.steps = 4
    s.useful_tokens_per_s = 10.0  # a field set later is written (after the others)
    s.write(tmp_path)
    back = json.loads((tmp_path / "summary.json").read_text())
    assert back == {**newer, "steps": 4, "useful_tokens_per_s": 10.0} and list(back)[:-1] == list(newer)
    (tmp_path / "summary.json").write_text("[1, 2]")
    assert RunSummary.read_or_none(tmp_path) is None and RunSummary.read_or_none(tmp_path / "missing") is None


def test_merge_monitor_adds_the_monitors_figures_once(tmp_path):
    trainer = {"model": "tiny-gpt2", "steps": 3, "final_train_loss": 1.5}
    monitor = {"gpu_monitor": {"available": False, "reason": "CPU run: no GPU to sample"},
               "cpu_monitor": {"available": True, "samples": 4, "real_mb": {"peak": 300.0, "mean": 200.0, "min": 100.0}}}
    assert merge_monitor(tmp_path, None, monitor) is None and not (tmp_path / "summary.json").exists()  # no trainer summary
    merged = merge_monitor(tmp_path, trainer, monitor)  # in memory: the trainer ran in this process
    assert json.loads((tmp_path / "summary.json").read_text()) == {**trainer, **monitor} == merged.to_dict()
    RunSummary.from_dict(trainer).write(tmp_path)  # spawned workers: rank 0's file in the run directory
    merge_monitor(tmp_path, None, monitor)
    assert json.loads((tmp_path / "summary.json").read_text()) == {**trainer, **monitor}


WRITES = ("write_text", "write_bytes", "replace", "rename", "dump", "copy", "copyfile", "move")


def test_exactly_one_place_writes_summary_json():
    """Scan src/shardlab: the only function that names summary.json and writes a file is RunSummary.write."""
    src = ROOT / "src" / "shardlab"
    writers = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = ast.get_source_segment(text, node) or ""
            if "summary.json" not in body and "SUMMARY_FILE" not in body:
                continue
            inner = [n for n in ast.walk(node) if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            skip = {id(m) for f in inner for m in ast.walk(f)}  # nested functions are checked on their own
            calls = [n for n in ast.walk(node) if id(n) not in skip and isinstance(n, ast.Call)]
            assigned = {t.id: ast.get_source_segment(text, a.value) or "" for a in ast.walk(node) if isinstance(a, ast.Assign)
                        for t in a.targets if isinstance(t, ast.Name)}

            def about_summary(c: ast.Call, text=text, assigned=assigned) -> bool:  # the call, or the variable it writes through, names the summary file
                target = c.func.value if isinstance(c.func, ast.Attribute) else (c.args[0] if c.args else c)
                where = (ast.get_source_segment(text, c) or "") + assigned.get(getattr(target, "id", ""), "")
                return "summary" in where.lower() or "self.path(" in where

            if any(about_summary(c) for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr in WRITES) or any(
                    about_summary(c) for c in calls if getattr(c.func, "id", None) == "open"):
                writers.append(f"{path.relative_to(src)}:{node.name}")
    assert writers == ["measure/summary.py:write"], writers
    # and RunSummary.write is called by the trainer (its rank 0's summary) and merge_monitor (the monitor's figures) only
    callers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if ".write(self.run_dir)" in p.read_text() or "summary.write(run_dir)" in p.read_text())
    assert callers == ["loop/trainer.py", "measure/summary.py"], callers


def test_report_reads_the_monitor_from_the_summary_and_its_figures_are_unchanged():
    run = read_run(GPU_RUN)
    for from_summary, from_csv in ((gpu_monitor_stats(run), gpu_csv_stats(run)), (cpu_monitor_stats(run), cpu_csv_stats(run))):
        assert from_summary.keys() == from_csv.keys()
        for k in from_csv:
            assert from_summary[k] == pytest.approx(from_csv[k], rel=1e-12), k
    # the rendered tables of a committed run with its CSVs: the same text whichever source the figures come from
    import shardlab.report.tables as tables

    _, new_tables, _, _ = build([GPU_RUN])
    old_gpu, old_cpu = tables.gpu_monitor_stats, tables.cpu_monitor_stats
    try:
        tables.gpu_monitor_stats, tables.cpu_monitor_stats = gpu_csv_stats, cpu_csv_stats  # what the report did before
        _, old_tables, _, _ = build([GPU_RUN])
    finally:
        tables.gpu_monitor_stats, tables.cpu_monitor_stats = old_gpu, old_cpu
    new_text, old_text = "\n".join(map(to_markdown, new_tables)), "\n".join(map(to_markdown, old_tables))
    assert "CPU memory over the run" in new_text and "| zero2_offload" in new_text
    assert new_text == old_text


def test_report_shows_the_monitor_figures_of_a_run_without_its_csvs():
    run = read_run(CPU_RUN)
    assert not (CPU_RUN / "cpu_memory.csv").exists() and cpu_csv_stats(run) is None
    stats = cpu_monitor_stats(run)
    assert stats["real_peak"] == pytest.approx(run.typed.cpu_monitor.real_mb.peak / 1e3)
    _, tabs, _, _ = build([CPU_RUN])
    cpu_table = next(t for t in tabs if t.key == "cpu-memory")
    assert f"{stats['real_peak']:.2f}" in to_markdown(cpu_table)
