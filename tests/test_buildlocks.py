"""A DeepSpeed op build killed half way leaves torch's FileBaton lock; every later run would wait on it forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from shardlab.launch.buildlocks import build_locks, clear_stale_build_locks, open_by_a_process


def _lock(root: Path, op: str, age_s: float) -> Path:
    path = root / "py311_cpu" / op / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_an_old_lock_nobody_holds_is_removed_and_named(tmp_path):
    stale = _lock(tmp_path, "cpu_adam", age_s=3600)
    said = []
    assert clear_stale_build_locks(said.append, roots=[tmp_path]) == [stale]
    assert not stale.exists()
    assert len(said) == 1 and "stale build lock" in said[0] and str(stale) in said[0]


def test_a_lock_a_live_build_holds_is_kept_however_old(tmp_path):
    held = _lock(tmp_path, "cpu_adam", age_s=3600)
    # a real other process that has the lock open, as torch's builder does (os.open, fd kept until release)
    holder = subprocess.Popen([sys.executable, "-c", f"import os,time; fd=os.open({str(held)!r}, os.O_RDONLY); print('ok', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        assert open_by_a_process(held)
        said = []
        assert clear_stale_build_locks(said.append, roots=[tmp_path]) == []
        assert held.exists() and said == []
    finally:
        holder.kill()
        holder.wait()
    assert not open_by_a_process(held)


def test_a_young_unheld_lock_is_kept_but_named(tmp_path):
    """It may be a build on another node sharing this home directory: named with the fix, not deleted."""
    young = _lock(tmp_path, "shm_comm", age_s=5)
    said = []
    assert clear_stale_build_locks(said.append, roots=[tmp_path]) == []
    assert young.exists() and str(young) in said[0] and "delete it" in said[0]


def test_both_layouts_are_scanned(tmp_path):
    """TORCH_EXTENSIONS_DIR=<root> puts ops at <root>/<op>; torch's default root adds a py*/cu* folder."""
    flat = tmp_path / "fused_adam" / "lock"
    flat.parent.mkdir()
    flat.touch()
    nested = _lock(tmp_path, "cpu_adam", age_s=0)
    assert build_locks([tmp_path]) == sorted([flat, nested])
    assert build_locks([tmp_path / "missing"]) == []
