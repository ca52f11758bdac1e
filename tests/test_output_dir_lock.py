"""One live run per output directory (launch/run_lock.py): a second `shardlab train` into the directory of a live one
is refused in one line naming the live run's pid, with or without --overwrite, and deletes nothing; once the live run
is gone, even by kill -9 (the kernel drops its flock), the directory is free again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_mistakes import assert_error, run_cli
from zygote import run_shardlab

from shardlab.launch.run_lock import LOCK_NAME, OutputDirLock, live_run

TRAIN = ["train", "--device", "cpu", "--dataset", "synthetic", "--seq-len", "16", "--micro-batch", "1"]


def files(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != LOCK_NAME}


def test_a_locked_output_dir_is_refused_with_or_without_overwrite(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cwd" / "run"
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("model: tiny-gpt2\n")  # the live run's files, as they are mid-run
    before = files(out)
    with OutputDirLock(out):  # another open file description: flock refuses it even within this process
        for extra in ([], ["--overwrite"], ["--resume", "auto"]):
            assert_error(TRAIN + ["--max-steps", "1", "--output-dir", str(out), *extra], tmp_path, capsys, monkeypatch,
                         "is in use by a live shardlab run", f"pid {os.getpid()}", f"kill {os.getpid()}")
            assert files(out) == before
        code, stdout, err = run_cli(TRAIN + ["--output-dir", str(out), "--dry-run"], tmp_path, capsys, monkeypatch)
        assert code == 0 and f"# note: `train` would refuse this: output dir {str(out)!r} is in use by a live shardlab run (pid {os.getpid()}" in stdout, err
    assert not (out / LOCK_NAME).exists()  # a run that ends leaves no lock file
    # a refused run leaves no directory behind either (the lock would have created it)
    fresh = tmp_path / "fresh"
    with OutputDirLock(fresh):
        pass
    assert not fresh.exists()


@pytest.mark.slow  # a live training process and three more commands
def test_a_second_run_never_touches_a_live_run_and_a_killed_one_frees_its_directory(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDLAB_SUPERVISED")}
    # The live run: `shardlab train` as a user starts it (a real interpreter: its pid is the supervising process's,
    # the one a user sees and would kill), long enough to outlive the test.
    live = subprocess.Popen([sys.executable, "-m", "shardlab", *TRAIN, "--max-steps", "100000", "--log-every", "5",
                             "--no-export", "--output-dir", str(out)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = ""
        while "step " not in line:  # training, its run files written
            line = live.stdout.readline()
            assert line, live.stderr.read()[-3000:]
        before = files(out)
        assert {"config.yaml", "env.json", "metrics.jsonl"} <= set(before)
        for extra in (["--overwrite"], []):
            second = run_shardlab([*TRAIN, "--max-steps", "2", "--output-dir", str(out), *extra], env=env, cwd=tmp_path, timeout=300)
            assert second.returncode == 2, second.stderr[-3000:]
            errors = [e for e in second.stderr.splitlines() if e.strip()]
            assert len(errors) == 1 and f"is in use by a live shardlab run (pid {live.pid}," in errors[0], second.stderr[-3000:]
            now = files(out)
            assert all(name in now and now[name] >= before[name] for name in before)  # nothing deleted or replaced
        assert live.poll() is None
        os.killpg(live.pid, signal.SIGKILL)  # the whole run, supervisor and trainer, with no chance to clean up
        live.wait(timeout=60)
        assert (out / LOCK_NAME).exists()  # nobody was left to remove it...
        deadline = time.monotonic() + 60  # the killed processes' exits (which drop their locks) run when they are scheduled
        while live_run(out) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        third = run_shardlab([*TRAIN, "--max-steps", "2", "--no-export", "--overwrite", "--output-dir", str(out)], env=env,
                             cwd=tmp_path, timeout=300)
        assert third.returncode == 0, third.stderr[-3000:]  # ...but the kernel dropped the lock with its holder
        assert "--overwrite: deleting the earlier run's files" in third.stdout
        assert not (out / LOCK_NAME).exists()
    finally:
        if live.poll() is None:
            os.killpg(live.pid, signal.SIGKILL)
            live.wait(timeout=60)
