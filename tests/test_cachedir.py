"""cachedir.built_once: a cached directory built by one process while the others wait (the ranks of a run all need the
same GGUF part at once: training/gguf_files.gguf_cache builds every part through it), never half-visible, and never
blocked by a builder that died. Checked with plain builders: a GGUF part's build costs each process tens of seconds of
imports, which the slow tier cannot spare (two processes parsing SmolLM2's 'info' part built it once, 28 s, 2026-11-27)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardlab.cachedir import built_once

SRC = str(Path(__file__).resolve().parents[1] / "src")

# A process that builds `out` with built_once: its builder appends one line to `log` and takes `secs` seconds.
BUILDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from shardlab.cachedir import built_once
    out, log, secs = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        (tmp / "half").write_text("x")
        time.sleep(secs)
        (tmp / "done").write_text("complete")

    got = built_once(out, build)
    print((got / "done").read_text())
""")


def _start(out: Path, log: Path, secs: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(out), str(log), str(secs)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_concurrent_processes_build_it_once_and_all_read_it(tmp_path):
    out, log = tmp_path / "cache" / "part", tmp_path / "builds.log"
    procs = [_start(out, log, 1.0) for _ in range(3)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results
    assert all(stdout.strip() == "complete" for stdout, _ in results)
    assert len(log.read_text().splitlines()) == 1  # one builder; the other two waited and read its directory
    assert sorted(x.name for x in out.iterdir()) == ["done", "half"]
    assert sorted(x.name for x in out.parent.iterdir()) == [".part.lock", "part"]  # no temporary directory left


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    out = tmp_path / "part"

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise ValueError("cannot parse")

    with pytest.raises(ValueError, match="cannot parse"):
        built_once(out, broken)
    assert not out.exists() and [x.name for x in tmp_path.iterdir()] == [".part.lock"]
    assert built_once(out, lambda tmp: (tmp / "ok").write_text("1")) == out and (out / "ok").read_text() == "1"
    # built: the builder is not called again
    assert built_once(out, lambda tmp: pytest.fail("rebuilt")) == out


def test_a_builder_killed_mid_build_does_not_block_the_next(tmp_path, monkeypatch):
    out, log = tmp_path / "part", tmp_path / "builds.log"
    holder = _start(out, log, 60.0)
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text()):  # it holds the lock and is building
        assert time.monotonic() < deadline and holder.poll() is None, holder.communicate()
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    # Not blocked: every lock this process takes from now on is non-blocking, so a lock the dead builder still held
    # would raise BlockingIOError here at once (a wall-clock bound, which this replaces, can flake on a loaded machine).
    real_flock = fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda f, op: real_flock(f, op | fcntl.LOCK_NB))
    assert built_once(out, lambda tmp: (tmp / "done").write_text("complete")) == out
    assert (out / "done").read_text() == "complete"
    assert not (out / "half").exists()  # nothing of the killed build's temporary directory
