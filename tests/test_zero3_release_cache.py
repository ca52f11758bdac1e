"""compat/zero3_release_cache.py: DeepSpeed's ZeRO-3 coordinator caches its release decisions
(PartitionedParameterCoordinator.__params_to_release, lru_cache'd, never cleared), so an eval before the first training
step left the eval trace's decisions in force for the whole run. The fix clears that cache when a new trace completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.compat import zero3_release_cache
from shardlab.compat.zero3_release_cache import apply_release_cache_fix

SRC = Path(__file__).resolve().parents[1] / "src"
PROBE = Path(__file__).resolve().parent / "zero3_release_probe.py"


@pytest.fixture
def coordinator(monkeypatch):
    """DeepSpeed's coordinator class, its reset_step restored after the test (the fix patches the class)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

    monkeypatch.setattr(PPC, "reset_step", PPC.reset_step)
    return PPC


def test_applying_the_fix_twice_installs_it_once(coordinator):
    original = coordinator.reset_step
    lines = []
    assert apply_release_cache_fix(lines.append)
    installed = coordinator.reset_step
    assert installed is not original and getattr(installed, zero3_release_cache._MARK)
    assert apply_release_cache_fix(lines.append)
    assert coordinator.reset_step is installed  # not wrapped a second time
    assert lines == []
    # the cache the fix clears is the one under DeepSpeed's decorators
    assert callable(zero3_release_cache._cached_params_to_release(coordinator).cache_clear)


def test_another_deepspeed_shape_leaves_it_alone_and_says_so(coordinator, monkeypatch):
    """No lru_cache under __params_to_release (another DeepSpeed): nothing is patched, one line is logged, no crash."""
    monkeypatch.setattr(coordinator, "_PartitionedParameterCoordinator__params_to_release", lambda self, m, s: set())
    original = coordinator.reset_step
    lines = []
    assert not apply_release_cache_fix(lines.append)
    assert coordinator.reset_step is original
    assert len(lines) == 1 and "not applied" in lines[0]


@pytest.mark.slow  # ~30 s on 2 cores: one process, four tiny ZeRO-3 offload engines (12 s of it importing DeepSpeed)
def test_eval_first_gathers_what_a_run_without_eval_gathers():
    """The real engine, one gloo rank (tests/zero3_release_probe.py): non-persistent elements gathered at the start of
    backward, per training micro-batch. Without the initial eval the tied embedding stays gathered from micro-batch 2
    on; DeepSpeed alone, after an eval, keeps the eval trace's decision to release it for the whole run; with the fix
    the run with the eval matches from micro-batch 3 on (micro-batch 2 records the training trace)."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    emb = out["embedding"]
    assert out["applied"]
    assert out["no_eval"][1:] == [emb] * 3  # the reference: the embedding is kept for the loss' backward
    assert out["eval_first"][2:] == [0, 0]  # the bug: the eval trace's release decision, reused
    assert out["eval_first_fixed"][2:] == out["no_eval"][2:]
    assert out["no_eval_fixed"] == out["no_eval"]  # without an eval the fix changes nothing
