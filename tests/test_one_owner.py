"""One of each, no dead code (issue 13): a scan of the source, nothing imported or run but `run_group` once.

Each helper below has exactly one definition in src/shardlab, and the copies it replaced (other names,
same job) are not back; the dead names removed with it do not reappear."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardlab"
TESTS = Path(__file__).resolve().parent
SOURCES = {p: p.read_text() for p in sorted(SRC.rglob("*.py"))}

# helper -> the module that owns it (relative to src/shardlab)
OWNERS = {
    "free_port": "runtime/distributed.py",
    "get_dotted": "dotted.py",
    "set_dotted": "dotted.py",
    "run_group": "runtime/procgroup.py",
    "end_group": "runtime/procgroup.py",
    "largest_that_fits": "planning/microbatch.py",
    "micro_candidates": "planning/microbatch.py",
    "processes_per_node": "runtime/distributed.py",
    "model_family": "layout.py",
    "activation_bytes": "planning/memory.py",
    "autocasts": "training/optim.py",  # whether forward runs under autocast: the run's and the planner's one answer
    "transformer_blocks": "training/models.py",
}

# the copies the owners replaced, and dead code removed: no `def`, no assignment, no use
GONE_DEFS = ("_free_port", "_set_dotted", "_get_dotted", "_kill_group", "_end_group", "_raw", "_nested")
GONE_NAMES = ("QA_FIELDS", "HUB_ALIASES", "NO_DECAY_HINTS", "MEASURED_H100", "named_keys")


def _where(name: str, sources: dict[Path, str]) -> list[str]:
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    return [str(p) for p, text in sources.items() if pattern.search(text)]


@pytest.mark.parametrize("name, owner", OWNERS.items())
def test_exactly_one_definition(name, owner):
    found = [p for p, text in SOURCES.items() for _ in re.finditer(rf"^\s*def\s+{name}\s*\(", text, re.M)]
    assert [str(p.relative_to(SRC)) for p in found] == [owner]


@pytest.mark.parametrize("name", GONE_DEFS)
def test_replaced_copies_are_not_back(name):
    tests = {p: p.read_text() for p in TESTS.glob("*.py")}
    assert not [p for p, text in {**SOURCES, **tests}.items() if re.search(rf"^\s*def\s+{name}\s*\(", text, re.M)]


@pytest.mark.parametrize("name", GONE_NAMES)
def test_removed_names_are_not_back(name):
    assert _where(name, SOURCES) == []


def test_removed_methods_are_not_back():
    def methods(path: str, cls: str) -> set[str]:
        tree = ast.parse(SOURCES[SRC / path])
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        return {n.name for n in node.body if isinstance(n, ast.FunctionDef)}

    assert "as_dict" not in methods("report/load.py", "Spread")
    assert "describe" not in methods("strategies/base.py", "Strategy")
    assert "received" not in SOURCES[SRC / "runtime/preemption.py"]  # ForwardToWorkers.received: set, never read


def test_no_if_that_only_passes():
    for path, text in SOURCES.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.If):
                assert not all(isinstance(s, ast.Pass) for s in node.body), f"{path.relative_to(SRC)}:{node.lineno}"


@pytest.mark.parametrize("marker, owner", [
    (r"os\.killpg\(", "runtime/procgroup.py"),  # process-group kill
    (r"start_new_session=True", "runtime/procgroup.py"),  # a command in its own group
    (r"\.bind\(\(\"127\.0\.0\.1\", 0\)\)", "runtime/distributed.py"),  # a free port (slurm.py's is shell in the sbatch script)
    (r"isinstance\(module, (torch\.)?nn\.ModuleList\)", "training/models.py"),  # the block finder
    (r"dotted\.split\(\"\.\"\)", "dotted.py"),  # walking a dotted key
    (r"os\.wait4\(", "runtime/procgroup.py"),
])
def test_the_work_itself_happens_in_one_place(marker, owner):
    found = sorted({str(p.relative_to(SRC)) for p, text in SOURCES.items() if re.search(marker, text)})
    assert found == [owner]


def test_run_group_ends_the_whole_group_on_timeout(tmp_path):
    from shardlab.runtime.procgroup import run_group

    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    run = run_group([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=None, env=None, timeout=2.0)
    assert run.timed_out and run.code < 0  # ended by the timeout (a child left to finish would not be timed_out)
    grandchild = int(pid_file.read_text())
    stat = Path(f"/proc/{grandchild}/stat")
    for _ in range(50):  # killed with the group (a zombie until init reaps it counts as gone)
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {grandchild} outlived its group")
    run = run_group([sys.executable, "-c", "raise SystemExit(3)"], stdout=None, stderr=None, env=None, timeout=30, grace=5)
    assert (run.code, run.timed_out) == (3, False) and run.usage.ru_maxrss > 0
