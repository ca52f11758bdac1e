"""examples/: every YAML loads, dry-runs offline through the real CLI, and quick-test trains for real.

The dry runs go through the real CLI entry point (`shardlab train --config F --dry-run`), all of them in one fresh
interpreter, with the Hugging Face offline switches set and a guard (a sitecustomize on PYTHONPATH) that makes any
outgoing connection fail; the driver notes whether `datasets` was imported by each: a dry run resolves the config and
the DeepSpeed JSON only, so it must touch neither the network nor any dataset.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardlab.config import load_config
from zygote import run_shardlab

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
YAMLS = sorted(EXAMPLES.glob("*.yaml"))
DATASETS_MARK = "SHARDLAB-TEST: datasets was imported"

GUARD = f"""
import atexit, socket, sys

def _no_network(*args, **kwargs):
    raise OSError("network access attempted during a dry run: " + repr(args[1:] or args))

socket.socket.connect = _no_network
socket.socket.connect_ex = _no_network
socket.create_connection = _no_network

@atexit.register
def _report():
    if "datasets" in sys.modules:
        sys.stderr.write({DATASETS_MARK!r} + "\\n")
"""


def subprocess_env(extra_path: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)  # never look like a worker of some outer launcher
    env.pop("WORLD_SIZE", None)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def guard_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("guard")
    (d / "sitecustomize.py").write_text(GUARD)
    return d


def test_examples_exist():
    names = {p.name for p in YAMLS}
    for required in ("quick-test.yaml", "gpt2-quick-test.yaml", "curriculum-zero3.yaml", "bloom-1b7-multigpu.yaml"):
        assert required in names
    assert (EXAMPLES / "ds-config-auto.json").is_file()


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_loads_and_documents_itself(path: Path):
    cfg = load_config(path)
    text = path.read_text()
    assert text.startswith("# Scenario:"), f"{path.name} must open with its comment block"
    for field in ("# Run:", "# Expect:"):
        assert field in text, f"{path.name} lacks a {field!r} line"
    assert f"examples/{path.name}" in text, f"{path.name}'s comment should show the command that runs it"
    given = [k for k in ("micro_batch", "grad_accum", "global_batch") if getattr(cfg, k) is not None]
    assert len(given) == 2, f"{path.name}: give exactly two of micro_batch/grad_accum/global_batch, got {given}"
    if cfg.deepspeed_config:
        assert (ROOT / cfg.deepspeed_config).is_file(), "deepspeed_config is relative to the repository root"


def test_ds_config_example_is_json_with_auto_values():
    data = json.loads((EXAMPLES / "ds-config-auto.json").read_text())
    assert data["train_micro_batch_size_per_gpu"] == "auto"
    assert data["train_batch_size"] == "auto"


# One fresh interpreter dry-runs every example in turn through the real CLI entry point (`shardlab.cli.main`), as
# `shardlab train --config F --dry-run` would: a process per example cost ~10 CPU-seconds of imports each. After each
# example the driver records whether `datasets` has been imported by then, so the first example that imports it is
# the one named; the environment is restored between examples.
DRIVER = """
import contextlib, io, json, os, sys
from shardlab.cli import main
results = {}
for path in sys.argv[2:]:
    out, err, env = io.StringIO(), io.StringIO(), dict(os.environ)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--config", path, "--dry-run"])
        except SystemExit as exc:
            code = exc.code
    os.environ.clear(); os.environ.update(env)
    results[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "datasets": "datasets" in sys.modules}
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def dry_runs(guard_dir: Path, tmp_path_factory) -> dict[str, dict]:
    result = tmp_path_factory.mktemp("dry-runs") / "results.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(result), *(str(p.relative_to(ROOT)) for p in YAMLS)],
                          cwd=ROOT, env=subprocess_env(guard_dir), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "network access attempted" not in proc.stderr
    return json.loads(result.read_text())


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_example_dry_run_offline(path: Path, dry_runs: dict[str, dict]):
    run = dry_runs[str(path.relative_to(ROOT))]
    assert run["code"] == 0, f"dry run of {path.name} failed:\n{run['stderr'][-3000:]}"
    assert not run["datasets"], f"dry run of {path.name} imported `datasets`"
    assert "network access attempted" not in run["stderr"]
    resolved = yaml.safe_load(run["stdout"].split("# DeepSpeed config")[0])
    cfg = load_config(path)
    assert resolved["model"] == cfg.model and resolved["strategy"] == cfg.strategy
    assert resolved["micro_batch"] and resolved["grad_accum"] and resolved["global_batch"]
    if cfg.strategy.startswith("zero") or cfg.strategy == "infinity":
        ds = json.loads(run["stdout"].split("# DeepSpeed config", 1)[1])
        assert ds["train_micro_batch_size_per_gpu"] == resolved["micro_batch"]
        assert ds["gradient_accumulation_steps"] == resolved["grad_accum"]
        assert ds["train_batch_size"] == resolved["global_batch"]
    else:
        assert "# DeepSpeed config" not in run["stdout"]


@pytest.mark.slow  # the fast tier's dp run is test_train_e2e's
def test_quick_test_trains_for_real(tmp_path: Path):
    out = tmp_path / "run"
    # forked from the session's zygote (zygote.py): a fresh `shardlab train` process without ~8 s of imports
    proc = run_shardlab(["train", "--config", "examples/quick-test.yaml", "--max-steps", "3", "--output-dir", str(out)],
                        env=subprocess_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tiny-gpt2" and summary["strategy"] == "dp"
    assert summary["steps"] == 3
    assert summary["global_batch"] == summary["micro_batch"] * summary["grad_accum"] * summary["world_size"]
    # It learned: the held-out loss (the same rows, before the first step and after the last) fell. At random init it
    # is ~ln(50257) = 10.82, so a bound on the loss alone passes with no learning at all; 3 warm-up steps (lr 0, 2e-4,
    # 4e-4) took it 10.72 -> 10.62 here; at lr 1e-9 (or with the updates lost) it stays at 10.72.
    assert math.isfinite(summary["final_train_loss"])
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.05, (summary["initial_eval_loss"], summary["final_eval_loss"])
    for name in ("config.yaml", "env.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert (out / "model" / "config.json").is_file()


def test_readme_mentions_only_existing_examples():
    readme = ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("no README.md")
    for name in set(re.findall(r"examples/([\w.-]+\.(?:yaml|json))", readme.read_text())):
        assert (EXAMPLES / name).is_file(), f"README.md names examples/{name}, which does not exist"
