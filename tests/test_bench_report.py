"""`shardlab bench` and `shardlab report` on real CPU runs of the quick suite.

One bench runs once for the module (``bench`` fixture): a small extra suite whose first cell fails (an unknown
model) and whose second runs twice (repeats), then the whole quick suite; every test reads its bench
directory and report. Each cell is a real `shardlab train` process (tiny-gpt2, gloo).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from patience import patience
from zygote import run_shardlab

from shardlab.bench import Overrides, expand, load_suite, plan_cells
from shardlab.bench.matrix import Suite
from shardlab.bench.runner import run_one
from shardlab.cli import main
from shardlab.errors import UserError
from shardlab.measure.monitor import stats
from shardlab.report.load import Run
from shardlab.report.tables import cpu_csv_stats

QUICK_CELLS = {"dp", "zero2", "zero3", "dp-bf16", "zero2_offload-pinned", "zero2_offload-unpinned", "zero3_offload", "dp-g2", "dp-mb4"}
EXTRA_SUITE = """
description: a failing cell first (the matrix must go on), then a cell run twice
repeats: 2
base:
  model: tiny-gpt2
  device: cpu
  dataset: {source: offline, eval_samples: 1}
  seq_len: 64
  precision: fp32
  micro_batch: 1
  gpus: 1
  max_steps: 5
  log_every: 1
  export: false
  monitor_interval_s: 0.2
parts:
  - name: extra
    cells:
      - {label: broken, set: {model: no-such-model}}
      - {label: dp-mb1, set: {strategy: dp}}
"""
TINY_GPT2_FLOPS_SEQ64 = 6 * (3_382_080 - 1024 * 64) + 12 * 2 * 64 * 64  # 19,997,568: PaLM appendix B by hand


def shardlab(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m shardlab ARGS` in a fresh process (forked from the session's zygote: zygote.py); a bench still
    starts each cell as a fresh interpreter of its own."""
    return run_shardlab(list(args), timeout=timeout)


@dataclass
class Bench:
    root: Path
    out: Path
    extra: Path
    proc: subprocess.CompletedProcess

    @property
    def state(self) -> dict:
        return json.loads((self.out / "bench.json").read_text())

    def cell(self, label: str) -> dict:
        return next(c for c in self.state["cells"] if c["label"] == label)

    def summary(self, label: str, repeat: int = 1) -> dict:
        return json.loads((self.out / "runs" / label / f"r{repeat}" / "summary.json").read_text())

    def run(self, label: str, repeat: int = 1) -> Run:
        path = self.out / "runs" / label / f"r{repeat}"
        return Run(path, json.loads((path / "summary.json").read_text()), {})

    def tables(self, key: str) -> list[dict]:
        return [t for t in json.loads((self.out / "report" / "tables.json").read_text()) if t["key"] == key]

    def row(self, key: str, label: str) -> dict:
        (table,) = self.tables(key)
        return next(r for r in table["rows"] if r["label"] == label)


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Bench:
    root = tmp_path_factory.mktemp("bench")
    extra = root / "extra.yaml"
    extra.write_text(EXTRA_SUITE)
    out = root / "quick"
    proc = shardlab("bench", "--suite", str(extra), "--suite", "quick", "--output-dir", str(out), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Bench(root, out, extra, proc)


# --------------------------------------------------------------------------------------------------
# bench


@pytest.mark.slow
def test_every_quick_cell_ran_in_its_own_process_and_run_directory(bench):
    cells = {c["label"]: c for c in bench.state["cells"]}
    assert QUICK_CELLS <= set(cells)
    run_dirs = set()
    for label in QUICK_CELLS:
        (rep,) = cells[label]["repeats"]
        assert rep["status"] == "ok" and rep["exit_code"] == 0, rep
        run_dir = bench.out / rep["run_dir"]
        for name in ("config.yaml", "summary.json", "metrics.jsonl", "env.json", "cpu_memory.csv"):
            assert (run_dir / name).is_file(), (label, name)
        assert (bench.out / rep["log"]).is_file()
        run_dirs.add(run_dir)
    assert len(run_dirs) == len(QUICK_CELLS)
    # each cell trained what it says: options reached the run's resolved config
    assert yaml.safe_load((bench.out / "runs/zero2_offload-unpinned/r1/config.yaml").read_text())["strategy_options"]["pin_memory"] is False
    assert bench.summary("dp-bf16")["precision"] == "bf16" and bench.summary("dp")["precision"] == "fp32"
    assert (bench.summary("dp-g2")["world_size"], bench.summary("dp-g2")["global_batch"]) == (2, 4)
    assert (bench.summary("dp-mb4")["micro_batch"], bench.summary("dp-mb4")["global_batch"]) == (4, 4)
    # cells shared by several tables ran once
    assert set(cells["dp-g2"]["parts"]) == {"quick/weak-scaling", "quick/strong-scaling"}


@pytest.mark.slow
def test_a_failing_cell_is_recorded_with_its_reason_and_the_matrix_goes_on(bench):
    first = bench.state["cells"][0]
    assert first["label"] == "broken"
    failed, skipped = first["repeats"]
    assert failed["status"] == "failed" and failed["exit_code"] == 2 and failed["kind"] == "user error"
    assert failed["reason"].startswith("model 'no-such-model' is not available offline")
    assert skipped["status"] == "skipped"
    assert not (bench.out / "runs" / "broken" / "r1").exists()  # bad input: no half-written run dir, no sampler CSVs
    assert re.search(r"broken r1: FAILED \(user error, exit 2\): model 'no-such-model'", bench.proc.stdout)
    assert all(r["status"] == "ok" for c in bench.state["cells"][1:] for r in c["repeats"])  # everything after it ran
    row = bench.row("runs", "broken")
    assert row["status"].startswith("FAILED (user error): model 'no-such-model'")
    assert "| broken |" in (bench.out / "report" / "report.md").read_text()


@pytest.mark.slow
def test_repeats_are_reported_as_median_and_min_max(bench):
    tps = [bench.summary("dp-mb1", k)["useful_tokens_per_s"] for k in (1, 2)]
    assert [r["status"] for r in bench.cell("dp-mb1")["repeats"]] == ["ok", "ok"]
    row = bench.row("runs", "dp-mb1")
    assert row["useful_tokens_per_s"] == pytest.approx(statistics.median(tps))
    assert (row["useful_tokens_per_s_min"], row["useful_tokens_per_s_max"], row["useful_tokens_per_s_n"]) == (min(tps), max(tps), 2)
    assert row["repeats"] == "2/2"


@pytest.mark.slow
def test_a_rerun_keeps_finished_runs_of_the_same_config(bench):
    (cell,) = [c for c in plan_cells([str(bench.extra)]) if c.label == "dp-mb1"]
    before = (bench.out / "runs/dp-mb1/r1/summary.json").stat().st_mtime
    rec = run_one(cell, 1, bench.out, timeout=patience(60), env={})
    assert rec["status"] == "ok" and rec["kept"] is True
    assert (bench.out / "runs/dp-mb1/r1/summary.json").stat().st_mtime == before


# --------------------------------------------------------------------------------------------------
# what every run measured


@pytest.mark.slow
def test_samplers_recorded_every_run_over_the_whole_process_tree(bench):
    for label in QUICK_CELLS:
        s = bench.summary(label)
        cpu = s["cpu_monitor"]
        assert cpu["available"] and cpu["samples"] >= 5 and cpu["scope"].startswith("the shardlab launcher")
        largest_rank_mb = max(r["cpu_rss_gib"] for r in s["memory_per_rank"]) * 2**30 / 1e6
        assert cpu["real_mb"]["peak"] >= 0.9 * largest_rank_mb, label  # the tree contains the ranks
        assert s["gpu_monitor"] == {"available": False, "reason": "CPU run: no GPU to sample"}
        assert not (bench.out / "runs" / label / "r1" / "gpu_memory.csv").exists()
        from_csv = cpu_csv_stats(bench.run(label))
        assert from_csv["real_peak"] * 1e3 == pytest.approx(cpu["real_mb"]["peak"])
    two = bench.summary("dp-g2")
    assert len(two["memory_per_rank"]) == 2 and two["cpu_monitor"]["max_processes"] >= 3  # launcher + 2 ranks
    per_rank_mb = [r["cpu_rss_gib"] * 2**30 / 1e6 for r in two["memory_per_rank"]]
    assert two["cpu_monitor"]["real_mb"]["peak"] > 1.5 * max(per_rank_mb)  # both ranks summed, not one


@pytest.mark.slow
def test_throughput_and_mfu_fields(bench):
    s = bench.summary("dp")
    assert s["warmup_steps_excluded"] == 3 and s["timed_steps"] == 7
    assert s["tokens_per_s"] == pytest.approx(s["global_batch"] * s["seq_len"] / s["step_time_median_s"])
    assert s["useful_tokens_per_s"] == pytest.approx(s["tokens_per_s"])  # packed: every token is useful
    assert s["epoch_time_projected_s"] == pytest.approx(s["steps_per_epoch"] * s["step_time_median_s"])
    assert s["flops_per_token"] == TINY_GPT2_FLOPS_SEQ64
    assert s["mfu"] is None and s["peak_tflops_per_device"] is None and "no dense peak" in s["mfu_note"]


# --------------------------------------------------------------------------------------------------
# report: the seed tables


@pytest.mark.slow
def test_every_seed_table_is_produced(bench):
    report = bench.out / "report"
    keys = {t["key"] for t in json.loads((report / "tables.json").read_text())}
    assert {"strategies", "pin-memory", "offload", "weak-scaling", "strong-scaling", "cpu-memory", "runs"} <= keys
    assert "gpu-memory" not in keys  # a CPU bench has no GPU samples: the empty table is left out, with a note
    for key in keys:
        assert (report / "tables" / f"{key}.csv").is_file()
    md = (report / "report.md").read_text()
    for title in ("Strategy comparison", "Pinned vs pageable", "ZeRO stage with and without CPU offload", "Weak scaling",
                  "Strong scaling", "CPU memory over the run", "Which strategy should I use?"):
        assert title in md
    assert "Not shown: GPU memory over the run (nvidia-smi CSV) (no run has GPU samples" in md
    assert {p.name for p in (report / "plots").iterdir()} >= {"memory.png", "throughput.png", "loss.png", "cpu_memory_time.png", "scaling.png"}


@pytest.mark.slow
def test_strategy_table_values_come_from_the_runs(bench):
    (table,) = bench.tables("strategies")
    assert [r["label"] for r in table["rows"]] == ["dp", "zero2", "zero3", "dp-bf16"]
    for r in table["rows"]:
        s = bench.summary(r["label"])
        assert r["useful_tokens_per_s"] == s["useful_tokens_per_s"] and r["epoch_time_s"] == s["epoch_time_projected_s"]
        assert r["final_loss"] == s["final_train_loss"] and r["eval_loss"] == s["final_eval_loss"]
        assert r["cpu_rss_peak_gb"] == pytest.approx(s["cpu_monitor"]["real_mb"]["peak"] / 1e3)


@pytest.mark.slow
def test_flagged_comparisons_are_flagged_with_the_equal_footing_figure_beside(bench):
    zero2, dp, dp_bf16 = (bench.summary(x)["useful_tokens_per_s"] for x in ("zero2", "dp", "dp-bf16"))
    row = bench.row("strategies", "zero2")
    assert row["vs_dp_baseline"] == "dp" and row["vs_dp"] == pytest.approx(zero2 / dp)  # fp32 vs fp32: honest
    assert row["flags"] == f"{zero2 / dp_bf16:.2f}x vs dp-bf16 (precision fp32 vs bf16; on equal footing: {zero2 / dp:.2f}x vs dp)"
    odd = bench.row("strategies", "dp-bf16")
    assert odd["vs_dp_baseline"] == "dp-bf16" and odd["vs_dp"] == pytest.approx(1.0)
    assert "precision bf16 vs fp32" in odd["flags"]
    html = (bench.out / "report" / "report.html").read_text()
    assert html.count('class="flagged"') >= 4
    assert "\u26a0 Some comparisons in this table are not on equal footing" in (bench.out / "report" / "report.md").read_text()


@pytest.mark.slow
def test_offload_table_mem_savings_and_runtime_delta(bench):
    (table,) = bench.tables("offload")
    rows = {(r["stage"], r["offload"]): r for r in table["rows"]}
    assert set(rows) == {("ZeRO-2", "no"), ("ZeRO-2", "yes (pinned)"), ("ZeRO-3", "no"), ("ZeRO-3", "yes (pinned)")}
    for stage, plain, off in (("ZeRO-2", "zero2", "zero2_offload-pinned"), ("ZeRO-3", "zero3", "zero3_offload")):
        e_plain, e_off = bench.summary(plain)["epoch_time_projected_s"], bench.summary(off)["epoch_time_projected_s"]
        r = rows[(stage, "yes (pinned)")]
        assert r["runtime_delta_pct"] == pytest.approx((e_off - e_plain) / e_plain * 100)
        rss_plain = bench.summary(plain)["cpu_monitor"]["real_mb"]["peak"]
        rss_off = bench.summary(off)["cpu_monitor"]["real_mb"]["peak"]
        assert r["cpu_rss_delta_pct"] == pytest.approx((rss_off - rss_plain) / rss_plain * 100)
        assert r["mem_savings_pct"] is None  # no GPU memory on a CPU run: not invented
    assert any("Mem Savings % needs GPU runs" in n for n in table["notes"])


@pytest.mark.slow
def test_pin_memory_table(bench):
    (table,) = bench.tables("pin-memory")
    pinned, unpinned = table["rows"]
    assert (pinned["label"], pinned["pinned"], unpinned["label"], unpinned["pinned"]) == \
        ("zero2_offload-pinned", "yes", "zero2_offload-unpinned", "no")
    e_p, e_u = (bench.summary(x)["epoch_time_projected_s"] for x in ("zero2_offload-pinned", "zero2_offload-unpinned"))
    assert unpinned["runtime_delta_pct"] == pytest.approx((e_u - e_p) / e_p * 100)
    assert unpinned["cpu_rss_mean_gb"] == pytest.approx(bench.summary("zero2_offload-unpinned")["cpu_monitor"]["real_mb"]["mean"] / 1e3, rel=1e-6)


@pytest.mark.slow
def test_weak_and_strong_scaling_tables(bench):
    (weak,) = bench.tables("weak-scaling")
    assert [(r["label"], r["gpus"], r["global_batch"]) for r in weak["rows"]] == [("dp", 1, 2), ("dp-g2", 2, 4)]
    s1, s2 = bench.summary("dp"), bench.summary("dp-g2")
    w = weak["rows"][1]
    assert w["efficiency_pct"] == pytest.approx((s2["samples_per_s"] / 2) / (s1["samples_per_s"] / 1) * 100)
    assert w["runtime_s"] == s2["total_time_s"] and w["steps_per_s"] == s2["steps_per_s"] and w["eval_loss"] == s2["final_eval_loss"]
    assert w["eval_samples_per_s"] == s2["epochs"][-1]["eval_samples_per_s"]
    assert not w["flags"]
    (strong,) = bench.tables("strong-scaling")
    assert [(r["label"], r["gpus"], r["global_batch"]) for r in strong["rows"]] == [("dp-mb4", 1, 4), ("dp-g2", 2, 4)]
    s1 = bench.summary("dp-mb4")
    assert strong["rows"][1]["speedup"] == pytest.approx(s2["samples_per_s"] / s1["samples_per_s"])


@pytest.mark.slow
def test_memory_tables(bench):
    assert bench.tables("gpu-memory") == []  # no GPU samples on a CPU: left out; test_every_seed_table_is_produced finds the note
    (cpu,) = bench.tables("cpu-memory")
    row = next(r for r in cpu["rows"] if r["label"] == "dp-g2")
    stats = cpu_csv_stats(bench.run("dp-g2"))
    assert row["cpu_rss_peak_gb"] == pytest.approx(stats["real_peak"]) and row["cpu_pct_mean"] == pytest.approx(stats["cpu_mean"])
    assert row["processes"] >= 3


@pytest.mark.slow
def test_report_of_loose_run_dirs_flags_batch_and_token_differences(bench, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["report", str(bench.out / "runs/zero2/r1"), str(bench.out / "runs/dp-mb1/r1"), "--output-dir", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"report: {out / 'report.md'}")
    (table,) = [t for t in json.loads((out / "tables.json").read_text()) if t["key"] == "strategies"]
    row = next(r for r in table["rows"] if r["strategy"] == "zero2")
    assert row["vs_dp"] is None and row["vs_dp_baseline"] == "no DP run on equal footing"
    assert "global_batch 2 vs 1" in row["flags"] and "tokens 1280 vs 320" in row["flags"] and "no equal-footing DP run" in row["flags"]


@pytest.mark.slow
def test_planner_prediction_is_compared_with_the_measurement(bench, tmp_path):
    from shardlab.config import load_config
    from shardlab.planning.planner import plan

    run = tmp_path / "zero2"
    shutil.copytree(bench.out / "runs/zero2/r1", run)
    sp = plan(load_config(run / "config.yaml"), gpu_memory_gb=80).strategies["zero2"]
    summary = json.loads((run / "summary.json").read_text())
    summary["plan"] = {"gpu_peak_gib": sp.gpu_peak / 2**30, "cpu_gib": sp.cpu_per_node / 2**30, "fits": sp.fits}
    summary["gpu_mem_peak_gib"] = 0.05  # fixture: a CPU run has no GPU peak; this stands in for the measured one
    (run / "summary.json").write_text(json.dumps(summary))
    from shardlab.report import build

    _, tables, _, _ = build([run])
    (t,) = [t for t in tables if t.key == "plan"]
    (row,) = t.rows
    assert row["predicted_gib"] == pytest.approx(sp.gpu_peak / 2**30)
    assert row["error_pct"] == pytest.approx((sp.gpu_peak / 2**30 - 0.05) / 0.05 * 100)
    assert row["fits"] == ("yes" if sp.fits else "no")


# --------------------------------------------------------------------------------------------------
# the HTML page in a real browser


PROBE = ('<script>addEventListener("load",function(){var i=[].slice.call(document.images),b=document.body;'
         'b.setAttribute("data-images",i.length);b.setAttribute("data-decoded",i.filter(function(x){return x.complete&&x.naturalWidth>0}).length);'
         'b.setAttribute("data-widths",i.map(function(x){return x.naturalWidth}).join(","));'
         'b.setAttribute("data-tables",document.querySelectorAll("table").length)});</script>')


def chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                    reason="headless Chromium is not installed (make setup installs Debian's `chromium` when root)")
def test_html_report_renders_in_headless_chromium_with_its_images(bench, tmp_path):
    page = (bench.out / "report" / "report.html").read_text()
    assert "<script" not in page and "http" not in page.split("<body>", 1)[-1].split("</h1>")[0]  # self-contained
    n_plots = len(list((bench.out / "report" / "plots").glob("*.png")))
    assert page.count("<img ") == n_plots >= 5 and page.count("data:image/png;base64,") == n_plots
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"))
    dom = chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom.stdout).group(1)
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', body))
    assert int(attrs["images"]) == n_plots and int(attrs["decoded"]) == n_plots, attrs  # every PNG decoded
    assert all(int(w) >= 400 for w in attrs["widths"].split(","))
    assert int(attrs["tables"]) >= 8
    for key in ("strategies", "pin-memory", "offload", "weak-scaling", "strong-scaling", "cpu-memory", "runs"):
        assert f'data-table="{key}"' in dom.stdout
    shot = tmp_path / "shot.png"
    res = chromium("--window-size=1280,2400", f"--screenshot={shot}", (bench.out / "report" / "report.html").as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    non_white = (pixels.mean(axis=2) < 0.95).mean()
    assert non_white > 0.05 and pixels.std() > 0.05  # text, tables and plots drawn, not a blank page


# --------------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    cases = [(["report", str(tmp_path / "missing")], "does not exist"),
             (["report", str(tmp_path)], "is neither a bench directory (bench.json) nor a run directory"),
             (["bench", "--suite", "no-such-suite"], "unknown bench suite 'no-such-suite'"),
             (["bench", "--gpus", "one,two", "--dry-run"], "is not a comma-separated list of int"),
             (["bench", "--precision", "bf17", "--dry-run"], "invalid value for 'precision'"),
             (["bench", "--repeats", "0", "--dry-run"], "--repeats 0 must be at least 1")]
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (args, err)
    assert not list(tmp_path.iterdir())  # nothing written


def test_bench_refuses_a_comparison_that_is_not_on_equal_footing():
    suite = Suite.model_validate({"name": "s", "base": {"model": "tiny-gpt2", "max_steps": 5, "micro_batch": 2},
                                  "parts": [{"name": "strategies", "axes": {"strategy": ["dp", "zero2"]},
                                             "cells": [{"label": "long", "set": {"strategy": "dp", "seq_len": 256}}]}]})
    with pytest.raises(UserError, match="cells would differ in seq_len"):
        expand([suite])
    suite.parts[0].cells[0].differs = ["seq_len", "tokens"]
    assert [c.label for c in expand([suite])] == ["dp", "zero2", "long"]


def test_bench_flags_override_the_suites(capsys):
    cells = plan_cells(["strategies"], Overrides(axes={"strategy": ["dp", "zero2"], "gpus": [1, 2]}, base={"max_steps": 7}))
    assert [c.label for c in cells] == ["dp-g1", "dp-g2", "zero2-g1", "zero2-g2", "dp-fp32-g1", "dp-fp32-g2"]
    assert {c.config["max_steps"] for c in cells} == {7}
    assert [c.config["precision"] for c in cells if c.label.startswith("dp-fp32")] == ["fp32", "fp32"]  # the cell's point is kept
    assert [c.label for c in plan_cells(["strategies"], Overrides(axes={"strategy": ["zero3"]}))] == ["zero3"]  # dp-fp32 dropped
    with pytest.raises(UserError, match="unknown config key 'no_such_key'"):
        plan_cells(["quick"], Overrides(base={"no_such_key": 1}))
    assert main(["bench", "--suite", "strategies", "--strategies", "zero2_offload", "--axis", "strategy_options.pin_memory=true,false",
                 "--axis", "compile=false", "--max-steps", "9", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["zero2_offload-pinned", "zero2_offload-unpinned"] and all("steps 9" in x for x in lines)


def test_builtin_suites_expand_on_equal_footing():
    for name in ("quick", "strategies", "pin-memory", "offload", "weak-scaling", "strong-scaling"):
        assert load_suite(name).description and plan_cells([name])
    assert len(plan_cells(["pin-memory", "offload"])) == 6  # the pinned offload cells are shared
    assert [c.label for c in plan_cells(["strategies"])] == ["dp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fsdp", "dp-fp32"]


def _as_gpu_run(src: Path, dst: Path, peak_gib: float, reserved_gib: float, used_mib: list[float]) -> None:
    """Fixture: a real CPU run dir given the GPU fields a GPU run would have (a CPU cannot measure them)."""
    shutil.copytree(src, dst)
    s = json.loads((dst / "summary.json").read_text())
    s.update(device_type="cuda", gpu_mem_peak_gib=peak_gib, gpu_mem_peak_reserved_gib=reserved_gib)
    util = [90.0 if i else 0.0 for i in range(len(used_mib))]
    used = stats([float(u) for u in used_mib])  # what the run's monitor merges into summary.json for that CSV (the report reads it)
    s["gpu_monitor"] = {"available": True, "samples": len(used_mib), "memory_used_mib": used, "utilization_pct": stats(util),
                        "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_used_mib": used}]}
    (dst / "summary.json").write_text(json.dumps(s))
    rows = ["timestamp,index,name,memory.used [MiB],memory.total [MiB],utilization.gpu [%]"]
    rows += [f"2026/11/21 10:00:0{i}.000,0,NVIDIA H100 80GB HBM3,{u},81559,{util[i]:.0f}" for i, u in enumerate(used_mib)]
    (dst / "gpu_memory.csv").write_text("\n".join(rows) + "\n")


@pytest.mark.slow
def test_gpu_columns_mem_savings_and_the_stacked_memory_plot(bench, tmp_path):
    _as_gpu_run(bench.out / "runs/zero2/r1", tmp_path / "zero2", 20.22, 23.05, [512, 20_000, 24_576])
    _as_gpu_run(bench.out / "runs/zero2_offload-pinned/r1", tmp_path / "zero2_offload", 16.35, 18.77, [512, 17_000, 20_480])
    from shardlab.report import build
    from shardlab.report.render import to_markdown

    cells, tables, plots, advice = build([tmp_path / "zero2", tmp_path / "zero2_offload"])
    (off,) = [t for t in tables if t.key == "offload"]
    row = next(r for r in off.rows if r["offload"].startswith("yes"))
    assert row["mem_savings_pct"] == pytest.approx((20.22 - 16.35) / 20.22 * 100)  # (no-offload - offload) / no-offload
    assert "Mem Savings %" in to_markdown(off) and "19.1" in to_markdown(off)
    (gpu,) = [t for t in tables if t.key == "gpu-memory"]
    g = next(r for r in gpu.rows if r["label"] == "zero2")
    assert (g["nvml_peak_gib"].median, g["nvml_min_gib"].median) == (24.0, 0.5)
    assert g["nvml_mean_gib"].median == pytest.approx((512 + 20_000 + 24_576) / 3 / 1024)
    assert g["util_mean"].median == 60.0
    assert {p.name for p in plots} >= {"memory", "gpu_memory_time"}
    assert next(p for p in plots if p.name == "memory").title == "Peak GPU memory per run"  # stacked: allocated, cache, outside torch
    assert any("saved 19% of peak GPU memory" in line for line in advice)


def test_a_cell_the_bench_never_finished_says_so(tmp_path):
    """A bench stopped by a time limit leaves planned cells without repeats: 'not finished', not 'failed: unknown'."""
    import json

    from shardlab.report.load import BENCH_FILE, load_bench
    from shardlab.report.tables import cell_status

    (tmp_path / BENCH_FILE).write_text(json.dumps({"cells": [
        {"label": "zero3_offload-unpinned", "parts": ["pin-memory/pin-memory"], "repeats_planned": 1, "repeats": []}]}))
    (cell,) = load_bench(tmp_path)
    assert not cell.ok and cell_status(cell).startswith("FAILED (not finished): the bench stopped before this cell ended")
