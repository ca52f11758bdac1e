"""benchmarks/plan_validation.py on CPU with a tiny preset: one grid cell (predicted vs measured host memory)
and the `--micro-batch auto` check through `shardlab train --micro-batch auto` (one real CPU trial in a
fresh process, as on a GPU). The GPU grid itself is run by the lead (benchmarks/plan_validation.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_validation.py"
BUDGET_GB = 1.0


pytestmark = pytest.mark.slow  # every test reads a training cell the script runs


@pytest.fixture(scope="module")
def validation(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan-validation")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "tiny-gpt2", "--seqs", "32", "--strategies", "dp",
         "--micro", "2", "--steps", "2", "--auto-check", "tiny-gpt2:dp:32", "--cpu-budget-gb", str(BUDGET_GB), "--out", str(out)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "plan_validation.json").read_text()), (out / "plan_validation.md").read_text()


def test_grid_cell_predicted_vs_measured(validation):
    _, result, md = validation
    [cell] = result["cells"]
    assert cell["rc"] == 0 and cell["model"] == "tiny-gpt2" and cell["strategy"] == "dp" and cell["seq"] == 32
    plan = cell["summary"]["plan"]
    assert {"gpu_peak_gib", "cpu_gib", "fits", "strategy"} <= set(plan) and plan["strategy"] == "dp"
    # CPU: the plan's host-memory prediction against the cell's peak RSS (wait4). For tiny-gpt2 nearly all of it is
    # the runtime (interpreter, torch, transformers, what they import, malloc arenas), and that peak is noisy: the same
    # command measured 0.557-0.623 GiB over five runs in one venv (predicted 0.695). So the bound here only says the
    # runtime base is right (no more than 10% under, at most 35% over); the host plan of models whose states matter is
    # checked at 20% by test_host_memory (offload runs on CPU).
    assert cell["predicted_gib"] == plan["cpu_gib"] and cell["measured_gib"] == cell["peak_rss_gib"] > 0.3
    assert 0.9 < cell["predicted_gib"] / cell["measured_gib"] < 1.35
    assert result["worst"]["cells"] == 1 and result["worst"]["error"] == pytest.approx(cell["predicted_gib"] / cell["measured_gib"] - 1)
    assert "| tiny-gpt2 | 32 | dp |" in md and "Worst error" in md
    assert cell["command"].startswith("shardlab train --model tiny-gpt2 --strategy dp --seq-len 32 --micro-batch 2")


def test_micro_batch_auto_runs_a_real_trial(validation):
    out, result, _ = validation
    auto = result["auto_check"]
    assert auto["rc"] == 0 and auto["found"] >= 1 and auto["found"] <= auto["plan_start"] <= 64
    # one real trial (a fresh `shardlab train` process) ran at the plan's value and measured its peak RSS
    assert auto["trials"][0]["micro"] == auto["plan_start"] and auto["trials"][-1]["result"] == "ran"
    assert 0.3 < auto["trials"][-1]["peak_gib"] <= BUDGET_GB
    assert "not applicable on CPU" in auto["next"]
    # the run itself used the micro batch found, and recorded the search in its plan
    summary = json.loads((out / "runs" / "auto" / "summary.json").read_text())
    assert summary["micro_batch"] == auto["found"] and summary["steps"] == 2
    assert summary["plan"]["micro_batch_auto"]["chosen"] == auto["found"]
    assert summary["plan"]["micro_batch_auto"]["budget_gib"] == pytest.approx(BUDGET_GB)
    log = (out / "runs" / "auto.log").read_text()
    assert f"--micro-batch auto: {auto['found']} (plan: {auto['plan_start']}" in log
