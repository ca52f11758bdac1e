"""launch/bytecode.py: the training processes keep their imports' bytecode where this Python would not."""

from __future__ import annotations

import os
import subprocess
import sys

from shardlab.launch import bytecode


def test_no_change_where_python_keeps_bytecode_itself(monkeypatch):
    monkeypatch.setattr(bytecode, "_unwritable_pycache", lambda package: False)
    assert bytecode.bytecode_env({}) == {}


def test_dont_write_bytecode_or_a_read_only_site_sends_it_to_shardlabs_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(bytecode, "_unwritable_pycache", lambda package: False)
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    env = bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1"})
    assert env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
    monkeypatch.setattr(bytecode, "_unwritable_pycache", lambda package: package == "transformers")
    assert bytecode.bytecode_env({})["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")


def test_a_users_prefix_and_the_opt_out_are_kept(monkeypatch):
    monkeypatch.setattr(bytecode, "_unwritable_pycache", lambda package: True)
    assert bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/x"}) == {}
    assert bytecode.bytecode_env({"PYTHONDONTWRITEBYTECODE": "1", bytecode.OPT_OUT: "0"}) == {}


def test_a_process_given_the_variables_writes_its_bytecode_under_the_prefix_only(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "some_module.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(src)}
    env.update(bytecode.bytecode_env(env))
    subprocess.run([sys.executable, "-c", "import some_module; assert some_module.VALUE == 42"], env=env, check=True)
    written = list((tmp_path / "cache" / "pycache").rglob("some_module*.pyc"))
    assert len(written) == 1 and not (src / "__pycache__").exists()
