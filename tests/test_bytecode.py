"""launch/bytecode.py: the training processes keep their imports' bytecode where this Python would not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.launch import bytecode


def test_no_change_where_python_keeps_bytecode_itself(monkeypatch):
    monkeypatch.setattr(bytecode, "_bytecode_missing", lambda: False)
    assert bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1"}) == {}  # pip compiled it at install: nothing to do


def test_missing_bytecode_is_sent_to_shardlabs_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(bytecode, "_bytecode_missing", lambda: True)
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    env = bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1"})
    assert env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}


def test_a_users_prefix_and_the_opt_out_are_kept(monkeypatch):
    monkeypatch.setattr(bytecode, "_bytecode_missing", lambda: True)
    assert bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/x"}) == {}
    assert bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1", bytecode.OPT_OUT: "0"}) == {}


def test_a_process_given_the_variables_writes_its_bytecode_under_the_prefix_only(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "some_module.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bytecode, "_bytecode_missing", lambda: True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(src)}
    env.update(bytecode.bytecode_env(env))
    subprocess.run([sys.executable, "-c", "import some_module; assert some_module.VALUE == 42"], env=env, check=True)
    written = list((tmp_path / "cache" / "pycache").rglob("some_module*.pyc"))
    assert len(written) == 1 and not (src / "__pycache__").exists()


def test_this_machines_pip_compiled_packages_have_their_bytecode():
    """Where pip compiled torch and transformers at install (this machine, CI), nothing is changed: a prefix would make
    every fresh cache compile them again."""
    import importlib.util

    if any(not Path(importlib.util.cache_from_source(str(Path(importlib.util.find_spec(p).origin).parent / r))).is_file()
           for p, r in bytecode.PROBES):
        pytest.skip("this Python's torch/transformers have no bytecode beside them")
    assert bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1"}) == {}
