"""Joining a job someone else launched: torchrun, and srun (SLURM variables only) — no relaunch, same losses.

The reference is shardlab's own launcher (`--gpus 2`, ranks forked from it on CPU): a strategy's losses must not
depend on who started the processes, or how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from patience import patience
from zygote import popen_shardlab, run_shardlab

from shardlab.runtime.distributed import free_port

ARGS = ["--model", "tiny-gpt2", "--max-steps", "6", "--micro-batch", "2", "--seq-len", "32", "--lr", "1e-3",
        "--dropout", "0", "--precision", "fp32", "--strategy", "zero2", "--log-every", "1", "--no-export",
        "--set", "dataset.eval_samples=1"]  # fmt: skip
TIMEOUT = 420

pytestmark = pytest.mark.slow  # two ranks in every test (conftest.py: the tiers)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture
def reference(shared_runs):
    """shardlab's own 2-rank launch, trained once per pytest run for every xdist worker (conftest.SharedRuns)."""
    run = shared_runs.get([*ARGS, "--gpus", "2"], name="own-launcher").check()
    assert "forked from this launcher" in run.stdout  # a CPU run forks its ranks (launcher.worker_start_method)
    return losses(run.out)


def test_exec_started_ranks_train_as_forked_ones(reference, tmp_path):
    """GPU runs start every rank as a fresh interpreter (CUDA cannot be initialised again in a fork); forced here on
    CPU, the same run gives the same losses as the forked ranks of the reference. The launching command itself is
    forked from the session's zygote (tests/zygote.py: SHARDLAB_* variables are read at run time); its ranks are the
    fresh interpreters under test."""
    out = tmp_path / "exec"
    proc = run_shardlab(["train", *ARGS, "--gpus", "2", "--output-dir", str(out)], timeout=TIMEOUT,
                        env={**os.environ, "SHARDLAB_WORKER_START": "exec"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fresh interpreters" in proc.stdout
    assert losses(out) == pytest.approx(reference, rel=1e-5)


def test_joins_torchrun(reference, tmp_path):
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "shardlab", "train", *ARGS, "--output-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launching" not in proc.stdout  # joined: shardlab did not start workers of its own
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert losses(out) == pytest.approx(reference, rel=1e-5)


def test_joins_srun_from_slurm_variables(reference, tmp_path):
    """Two processes that carry only what `srun -n2` sets (SLURM_PROCID, SLURM_NTASKS, ...): they map it
    onto torch's variables, pick node list's first host as master, and train as one world of two. Each is a
    `shardlab train` forked from the session's zygote (tests/zygote.py: a launcher's variables are read at run time),
    not two real interpreters importing torch side by side."""
    out = tmp_path / "srun"
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_JOB_NODELIST="localhost",
                   MASTER_PORT=port)  # fmt: skip
        procs.append(popen_shardlab(["train", *ARGS, "--output-dir", str(out)], tmp_path / f"rank{rank}.stdout",
                                    tmp_path / f"rank{rank}.stderr", env=env))  # fmt: skip
    for rank, p in enumerate(procs):
        assert p.wait(timeout=patience(TIMEOUT)) == 0, (tmp_path / f"rank{rank}.stderr").read_text()[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    assert losses(out) == pytest.approx(reference, rel=1e-5)
