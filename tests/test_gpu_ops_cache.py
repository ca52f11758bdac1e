"""benchmarks/gpu_ops_cache.sh: a JIT-built op saved on one machine is up to date for ninja on the next, whose
DeepSpeed sources were installed after the build (the wheelhouse installs them anew on every GPU machine). A tiny
ninja project stands in for torch's extension build (the same compile rule with a gcc deps file, then a link)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_ops_cache.sh"

NINJA = """ninja_required_version = 1.3
cc = cc
rule compile
  command = $cc -MMD -MF $out.d -I{csrc} -fPIC -c $in -o $out
  depfile = $out.d
  deps = gcc
rule link
  command = $cc -shared $in -o $out
build op.o: compile {csrc}/op.c
build fake_op.so: link op.o
"""


def ninja(build: Path, *args: str) -> str:
    return subprocess.run(["ninja", "-C", str(build), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("ninja") is None or shutil.which("cc") is None, reason="needs ninja and a C compiler")
def test_a_restored_build_is_up_to_date_on_a_machine_with_newer_sources(tmp_path):
    csrc, root, whl = tmp_path / "csrc", tmp_path / "ext", tmp_path / "whl"
    csrc.mkdir()
    whl.mkdir()
    (csrc / "op.h").write_text("int op(int x);\n")
    (csrc / "op.c").write_text('#include "op.h"\nint op(int x) { return 2 * x; }\n')
    (root / "fake_op").mkdir(parents=True)
    (root / "fake_op" / "build.ninja").write_text(NINJA.format(csrc=csrc))
    ninja(root / "fake_op")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "OPS": "fake_op", "WHL": str(whl), "DS_CSRC": str(csrc)}
    saved = subprocess.run(["bash", str(SCRIPT), "save", str(whl)], env=env, capture_output=True, text=True, check=True)
    assert "saved fake_op" in saved.stdout, saved.stdout + saved.stderr
    assert len(list(whl.glob("ds-ops-*.tar.gz"))) == 1

    built = (root / "fake_op" / "op.o").stat().st_mtime
    later = (built + 60, built + 60)  # explicit times: a filesystem's clock granularity cannot tie them with the build
    shutil.rmtree(root)  # the next machine: no build, and sources installed after the build was made
    for source in csrc.iterdir():
        os.utime(source, later)
    restored = subprocess.run(["bash", str(SCRIPT), "restore"], env=env, capture_output=True, text=True, check=True)
    assert "restored" in restored.stdout, restored.stdout + restored.stderr
    assert "no work to do" in ninja(root / "fake_op", "-n")  # what torch's loader runs would rebuild nothing

    os.utime(csrc / "op.c", later)  # a source changed after the restore: built again
    assert "no work to do" not in ninja(root / "fake_op", "-n")


def test_no_saved_build_is_said_and_not_an_error(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "WHL": str(tmp_path)}
    restored = subprocess.run(["bash", str(SCRIPT), "restore"], env=env, capture_output=True, text=True)
    assert restored.returncode == 0 and "ops build when first needed" in restored.stdout
