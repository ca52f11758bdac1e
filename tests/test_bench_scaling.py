"""`shardlab bench --suite scaling`: weak scaling 1 -> N GPUs over models x strategies x eager/compiled, interleaved repeats.

The fast tests expand the suite and refuse bad input without running anything. The slow one runs the suite on 1 and
2 CPU ranks (gloo, tiny-gpt2, dp and zero2 eager, 2 repeats: 8 fresh `shardlab train` processes) once for the module
(``scaling`` fixture) and checks the order the runs ran in, the report's arithmetic against the runs' own summary.json,
and the efficiency plot. Compiled cells are left out of the CPU run (inductor needs ~90 s per cell on 2 cores); their
expansion is checked in the fast tier.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from zygote import run_shardlab

from shardlab.bench import Overrides, interleaved, plan_cells, run_order
from shardlab.bench.matrix import Cell
from shardlab.cli import main
from shardlab.errors import UserError

CPU_ARGS = ["--suite", "scaling", "--device", "cpu", "--models", "tiny-gpt2", "--strategies", "dp,zero2", "--axis", "compile=false",
            "--gpu-counts", "1,2", "--precision", "fp32", "--seq-len", "64", "--micro-batch", "2", "--max-steps", "8", "--repeats", "2"]
ROUND = ["dp-g1", "dp-g2", "zero2-g1", "zero2-g2"]  # the cells, in matrix order


# --------------------------------------------------------------------------------------------------
# the matrix (nothing runs)


def test_scaling_suite_crosses_models_strategies_modes_and_this_machines_gpu_counts():
    cells = plan_cells(["scaling"], Overrides(base={"device": "cpu"}))  # on a CPU: `gpus: machine` = 1 and 2 processes
    points = {(c.config["model"], c.config["strategy"], c.config["compile"], c.config["gpus"]) for c in cells}
    assert len(cells) == len(points) == 3 * 5 * 2 * 2
    assert {p[0] for p in points} == {"gpt2-large", "bloom-1b7", "llama-3.2-1b"}
    assert {p[1] for p in points} == {"dp", "zero1", "zero2", "zero3", "fsdp"} and {p[3] for p in points} == {1, 2}
    for c in cells:  # the same per-GPU micro-batch at every GPU count: the global batch grows with the GPUs
        assert (c.config["micro_batch"], c.config["grad_accum"], c.config["seq_len"], c.config["precision"]) == (8, 1, 1024, "bf16")
        assert c.repeats == 3
    assert interleaved(["scaling"]) and not interleaved(["strategies"])


def test_compile_is_crossed_only_with_strategies_whose_spec_supports_it():
    left_out: list[str] = []
    cells = plan_cells(["scaling"], Overrides(axes={"model": ["tiny-gpt2"], "strategy": ["dp", "pipeline"], "gpus": [1, 2]},
                                              base={"device": "cpu"}), left_out)
    assert sorted((c.config["strategy"], c.config["compile"], c.config["gpus"]) for c in cells) == [
        ("dp", False, 1), ("dp", False, 2), ("dp", True, 1), ("dp", True, 2), ("pipeline", False, 1), ("pipeline", False, 2)]
    assert len(left_out) == 2 and all("pipeline does not support compile" in line for line in left_out)


def test_on_gpus_a_refused_zero3_compile_is_left_out_with_the_refusals_reason(monkeypatch, tmp_path):
    """zero3 --compile refused before any worker (strategies/deepspeed_config.compile_problem: a DeepSpeed JSON that turns
    the memory-efficient linear on): the suite leaves those cells out and says why, instead of running cells that fail;
    eager zero3 and fsdp keep theirs. Without that JSON BLOOM's zero3 --compile cells run (torch's own linear)."""
    import json

    monkeypatch.setattr("shardlab.bench.machine.visible_gpus", lambda: 2)
    axes = {"model": ["bloom-1b7", "llama-3.2-1b"], "strategy": ["zero3", "fsdp"]}
    assert ("bloom-1b7", "zero3", True) in {(c.config["model"], c.config["strategy"], c.config["compile"])
                                            for c in plan_cells(["scaling"], Overrides(axes=axes))}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"memory_efficient_linear": True}}))
    left_out: list[str] = []
    cells = plan_cells(["scaling"], Overrides(axes=axes, base={"deepspeed_config": str(ds)}), left_out)
    kept = {(c.config["model"], c.config["strategy"], c.config["compile"]) for c in cells}
    assert not {("bloom-1b7", "zero3", True), ("llama-3.2-1b", "zero3", True)} & kept
    assert {("bloom-1b7", "zero3", False), ("bloom-1b7", "fsdp", True), ("llama-3.2-1b", "fsdp", True)} <= kept
    assert len(left_out) == 4 and all("memory_efficient_linear true with zero3 --compile" in line for line in left_out), left_out

def test_a_cuda_suite_on_a_machine_without_gpus_is_refused_when_expanded(monkeypatch):
    monkeypatch.setattr("shardlab.bench.machine.visible_gpus", lambda: 0)
    with pytest.raises(UserError, match="runs on CUDA GPUs but this machine has none"):
        plan_cells(["scaling"])
    monkeypatch.setattr("shardlab.bench.machine.visible_gpus", lambda: 8)
    assert sorted({c.config["gpus"] for c in plan_cells(["scaling"])}) == [1, 2, 4, 8]
    monkeypatch.setattr("shardlab.bench.machine.visible_gpus", lambda: 3)
    assert sorted({c.config["gpus"] for c in plan_cells(["scaling"])}) == [1, 2, 3]


def test_interleaved_order_is_round_robin_over_cells():
    cells = [Cell(label=name, config={}, repeats=r) for name, r in (("a", 2), ("b", 3), ("c", 1))]
    named = [(cells[i].label, k) for i, k in run_order(cells, interleave=True)]
    assert named == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2), ("b", 3)]
    assert [(cells[i].label, k) for i, k in run_order(cells)] == [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("b", 3), ("c", 1)]


# --------------------------------------------------------------------------------------------------
# bad input: one line, before any run starts


def _refused(argv: list[str], tmp_path: Path, capsys, *words: str) -> None:
    out = tmp_path / "bench"
    capsys.readouterr()
    assert main([*argv, "--output-dir", str(out)]) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()  # nothing ran, nothing written


def test_bad_input_is_refused_in_one_line_before_any_run(tmp_path, capsys, monkeypatch):
    cpu = ["bench", "--suite", "scaling", "--device", "cpu", "--gpu-counts", "1,2"]
    _refused([*cpu, "--models", "tiny-gpt2,no-such-model"], tmp_path, capsys, "model 'no-such-model' is not available offline")
    _refused([*cpu, "--models", "gpt2-larg"], tmp_path, capsys, "did you mean the preset 'gpt2-large'", "--models gpt2-large")
    _refused(["bench", "--suite", "scaling", "--device", "cuda"], tmp_path, capsys, "this machine has none")  # no CUDA here
    monkeypatch.setattr("shardlab.bench.machine.visible_gpus", lambda: 1)  # a one-GPU machine
    _refused(["bench", "--suite", "scaling", "--gpu-counts", "1,2,4"], tmp_path, capsys,
             "GPU count 2, 4 but this machine has 1 GPU", "--gpu-counts")
    _refused(["bench", "--suite", "scaling", "--gpu-counts", "1,2", "--dry-run"], tmp_path, capsys, "this machine has 1 GPU")
    assert main(["bench", "--suite", "scaling", "--dry-run"]) == 0  # `gpus: machine` on one GPU: a single count
    # 3 models x 5 strategies x eager/compiled
    assert len([line for line in capsys.readouterr().out.splitlines() if "scaling/scaling" in line]) == 30
    assert {c.config["gpus"] for c in plan_cells(["scaling"])} == {1}


# --------------------------------------------------------------------------------------------------
# the suite on 1 and 2 CPU ranks


@dataclass
class Scaling:
    out: Path
    proc: subprocess.CompletedProcess

    @property
    def state(self) -> dict:
        return json.loads((self.out / "bench.json").read_text())

    def summaries(self, label: str) -> list[dict]:
        return [json.loads((self.out / "runs" / label / f"r{k}" / "summary.json").read_text()) for k in (1, 2)]

    def tables(self, key: str) -> list[dict]:
        return [t for t in json.loads((self.out / "report" / "tables.json").read_text()) if t["key"] == key]


@pytest.fixture(scope="module")
def scaling(tmp_path_factory) -> Scaling:
    out = tmp_path_factory.mktemp("scaling") / "bench"
    proc = run_shardlab(["bench", *CPU_ARGS, "--output-dir", str(out)], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Scaling(out, proc)


@pytest.mark.slow
def test_repeats_ran_interleaved_round_robin_over_the_cells(scaling):
    expected = [(label, k) for k in (1, 2) for label in ROUND]
    state = scaling.state
    assert state["order"] == "interleaved" and [c["label"] for c in state["cells"]] == ROUND
    records = sorted((r["order"], r["started"], c["label"], r["repeat"]) for c in state["cells"] for r in c["repeats"])
    assert all(r[0] == i for i, r in enumerate(records, 1)) and [r[1] for r in records] == sorted(r[1] for r in records)
    assert [(label, k) for _, _, label, k in records] == expected
    # the runs' own files say the same: each summary.json was written when its run ended
    ended = sorted(expected, key=lambda lk: (scaling.out / "runs" / lk[0] / f"r{lk[1]}" / "summary.json").stat().st_mtime_ns)
    assert ended == expected
    started = [line.split("] ", 1)[1].split(":")[0] for line in scaling.proc.stdout.splitlines()
               if line.startswith("[bench ") and line.endswith("running ...")]
    assert started == [f"{label} r{k}" for label, k in expected]
    for label in ROUND:
        s1, s2 = scaling.summaries(label)
        assert s1["world_size"] == s2["world_size"] == int(label[-1]) and s1["micro_batch"] == 2  # same per-rank micro-batch
        assert s1["global_batch"] == 2 * s1["world_size"]


@pytest.mark.slow
def test_scaling_table_arithmetic_comes_from_the_runs_summaries(scaling):
    (table,) = scaling.tables("scaling")
    assert table["title"] == "Weak scaling, 1 \u2192 N CPU processes: tiny-gpt2 (fp32, seq 64, micro 2 per process, 8 steps)"
    assert [(r["strategy"], r["mode"]) for r in table["rows"]] == [("dp", "eager"), ("zero2", "eager")]
    for row in table["rows"]:
        tps = {n: [s["useful_tokens_per_s"] for s in scaling.summaries(f"{row['strategy']}-g{n}")] for n in (1, 2)}
        for n in (1, 2):
            assert row[f"tok_s_{n}"] == pytest.approx(statistics.median(tps[n]))
            assert (row[f"tok_s_{n}_min"], row[f"tok_s_{n}_max"], row[f"tok_s_{n}_n"]) == (min(tps[n]), max(tps[n]), 2)
        # weak-scaling efficiency = tok/s(2) / (2 x tok/s(1)), medians over the repeats
        assert row["eff_2"] == pytest.approx(statistics.median(tps[2]) / (2 * statistics.median(tps[1])) * 100)
        assert row["mfu_1"] is None and row["mfu_2"] is None  # no dense peak for a CPU: none invented
        assert row["repeats"] == "2/2, 2/2" and row["status"] == "ok" and not row["flags"]
    (memory,) = scaling.tables("scaling-memory")
    assert [(r["strategy"], r["gpus"]) for r in memory["rows"]] == [("dp", 1), ("dp", 2), ("zero2", 1), ("zero2", 2)]
    for r in memory["rows"]:
        runs = scaling.summaries(r["label"])
        assert r["predicted_host_gib"] == runs[0]["plan"]["cpu_gib"] and r["predicted_gib"] is None  # the run's own plan; CPU: host only
        measured = statistics.median(s["cpu_monitor"]["real_mb"]["peak"] * 1e6 / 2**30 for s in runs)
        assert r["measured_host_gib"] == pytest.approx(measured)
        assert r["host_error_pct"] == pytest.approx((r["predicted_host_gib"] - measured) / measured * 100)


@pytest.mark.slow
def test_efficiency_plot_is_written_and_embedded_in_the_report(scaling):
    report = scaling.out / "report"
    png = report / "plots" / "weak_scaling_efficiency.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (report / "report.md").read_text()
    assert "![Weak-scaling efficiency](plots/weak_scaling_efficiency.png)" in md
    assert "### Weak scaling, 1 \u2192 N CPU processes: tiny-gpt2" in md and "| Efficiency % at 2 |" in md
    html = (report / "report.html").read_text()
    assert '<figure id="plot-weak_scaling_efficiency"><img alt="Weak-scaling efficiency" src="data:image/png;base64,' in html
    assert 'data-table="scaling"' in html and 'data-table="scaling-memory"' in html


@pytest.mark.slow
def test_a_time_budget_keeps_finished_runs_and_starts_no_new_one(scaling, tmp_path):
    copy = tmp_path / "bench"
    shutil.copytree(scaling.out, copy)
    assert CPU_ARGS[-2:] == ["--repeats", "2"]
    proc = run_shardlab(["bench", *CPU_ARGS[:-1], "3", "--budget-s", "0.001", "--output-dir", str(copy)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "time budget of 0 s: 4 of 12 runs not started (they would not end within it); the same command continues" in proc.stdout
    state = json.loads((copy / "bench.json").read_text())
    assert state["budget_spent"]["runs_not_started"] == 4
    walls = {c["label"]: max(r["wall_s"] for r in c["repeats"]) for c in scaling.state["cells"]}
    assert state["walls_s"] == walls  # what the next continuation judges its budget by, though every run here was kept
    assert all([r["kept"] for r in c["repeats"]] == [True, True] for c in state["cells"])
    (table,) = [t for t in json.loads((copy / "report" / "tables.json").read_text()) if t["key"] == "scaling"]
    assert {r["repeats"] for r in table["rows"]} == {"2/3, 2/3"}


@pytest.mark.slow
def test_gpu_runs_show_mfu_and_the_planned_gpu_peak_beside_the_measured_one(scaling, tmp_path):
    """The CPU runs given the fields a GPU run records (a CPU cannot measure them): MFU and the per-GPU peaks."""
    from shardlab.report import build

    copy = tmp_path / "bench"
    shutil.copytree(scaling.out, copy)
    for path in copy.glob("runs/*/r*/summary.json"):
        s = json.loads(path.read_text())
        world = s["world_size"]
        s.update(device_type="cuda", mfu=0.30 + 0.01 * world, gpu_mem_peak_gib=10.0 + world)
        s["plan"].update(gpu_peak_gib=11.0 + world, fits=True)
        path.write_text(json.dumps(s))
    _, tables, plots, _ = build([copy])
    (table,) = [t for t in tables if t.key == "scaling"]
    assert table.title.startswith("Weak scaling, 1 \u2192 N GPUs: tiny-gpt2") and "per GPU" in table.title
    for row in table.rows:
        assert (row["mfu_1"].median, row["mfu_2"].median) == (pytest.approx(31.0), pytest.approx(32.0))
    (memory,) = [t for t in tables if t.key == "scaling-memory"]
    for r in memory.rows:
        assert (r["predicted_gib"], r["measured_gib"].median) == (11.0 + r["gpus"], 10.0 + r["gpus"])
        assert r["error_pct"] == pytest.approx(1 / (10.0 + r["gpus"]) * 100)
    assert "weak_scaling_efficiency" in {p.name for p in plots}


def test_adapters_suite_puts_lora_and_qlora_beside_full_fine_tuning_at_one_batch():
    """`--suite adapters`: full fine-tuning (fsdp, zero3) and LoRA / QLoRA (dp) of one model at the same micro-batch,
    sequence, precision and steps, so the report compares them on equal footing."""
    cells = plan_cells(["adapters"], Overrides(base={"device": "cpu"}))
    by_label = {c.label: c.config for c in cells}
    assert set(by_label) == {"fsdp", "zero3", "lora", "qlora"}
    methods = {label: (cfg.get("peft") or {}).get("method") for label, cfg in by_label.items()}
    assert methods == {"fsdp": None, "zero3": None, "lora": "lora", "qlora": "qlora"}
    assert by_label["lora"]["strategy"] == by_label["qlora"]["strategy"] == "dp"  # qlora trains under dp only
    footing = {(c["model"], c["micro_batch"], c["seq_len"], c["precision"], c["max_steps"]) for c in by_label.values()}
    assert footing == {("llama-2-7b", 4, 1024, "bf16", 20)}


def test_the_guide_names_the_fastest_at_the_largest_count_and_the_one_that_keeps_the_least():
    """From two H200s' runs (benchmarks/results/2026-11-29-h200x2-scaling-bars, llama-3.2-1b, medians of 3): the
    report's "which strategy" line quotes the weak-scaling table at 2 GPUs, its fastest row and its lowest efficiency."""
    from shardlab.report import build
    from shardlab.report.guide import guide

    runs = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-29-h200x2-scaling-bars/call1-2-llama"
    cells, tables, _, _ = build([runs])
    (table,) = [t for t in tables if t.key == "scaling"]
    fastest = max(table.rows, key=lambda r: r["tok_s_2"].median)
    lowest = min(table.rows, key=lambda r: r["eff_2"])
    assert (fastest["strategy"], fastest["mode"], lowest["strategy"]) == ("fsdp", "compiled", "zero3")
    (line,) = [g for g in guide(tables, cells) if "on 2 GPUs" in g]
    assert "fastest is **fsdp compiled** at 113.7k" in line and f"{fastest['eff_2']:.1f}% efficiency" in line
    assert f"zero3 keeps the least of its speed per GPU ({lowest['eff_2']:.1f}%)" in line
