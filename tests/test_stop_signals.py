"""A stop sent to the pid of `shardlab train` alone, as IDEs and schedulers send it: SIGINT used to be ignored (only a
terminal's Ctrl-C, which reaches every process of the run, stopped it) and the run went on to exit 0. Now it stops the
workers after their current step, with a checkpoint where the run saves them (--save-every), and exits 130; SIGTERM
keeps its contract with `shardlab slurm`: checkpoint, exit 75 to be requeued."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


@pytest.mark.slow  # a real `shardlab train` (one or two ranks), stopped mid-run
@pytest.mark.parametrize("sig, gpus, save_every, code", [
    ("SIGINT", 1, None, 130),
    ("SIGINT", 2, 100000, 130),
    ("SIGTERM", 1, None, 75),
], ids=["sigint-1rank", "sigint-2ranks-save-every", "sigterm-1rank"])  # fmt: skip
def test_a_signal_to_the_launchers_pid_alone_stops_the_run(sig, gpus, save_every, code, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDLAB_SUPERVISED")}
    argv = [sys.executable, "-m", "shardlab", "train", "--device", "cpu", "--gpus", str(gpus), "--dataset", "synthetic",
            "--seq-len", "16", "--micro-batch", "1", "--max-steps", "100000", "--log-every", "2", "--no-export",
            "--output-dir", str(out)] + (["--save-every", str(save_every)] if save_every else [])
    # A session of its own: no controlling terminal, as under an IDE or a scheduler (and the test's own Ctrl-C stays here)
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = ""
        while "step " not in line:  # training
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
        proc.send_signal(getattr(signal, sig))  # this pid only, not its process group
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    stopped = [e for e in err.splitlines() if e.startswith(f"[shardlab] stopped by {sig} after step ")]
    assert len(stopped) == 1, err[-3000:]
    checkpointed = save_every is not None or sig == "SIGTERM"
    assert ("checkpoint " in stopped[0] and " written" in stopped[0] and "no checkpoint" not in stopped[0]) == checkpointed
    assert (out / "checkpoints").is_dir() == checkpointed
    assert not (out / "summary.json").exists()  # stopped, not finished
