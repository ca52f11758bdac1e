"""`shardlab bench --cells FILE`: a list of `shardlab train` lines run by the bench's own runner (bench/cellfile.py).

The runs here are a stand-in command (the runner's SHARDLAB_COMMAND swapped for a short Python one-liner) so that what
the runner does with each line (its environment, its own timeout, failures recorded) is seen without training; real
training cells run in the bench suites' tests."""

from __future__ import annotations

import json
import sys

import pytest

from shardlab.bench import bench
from shardlab.bench import runner
from shardlab.bench.cellfile import read_cells_file
from shardlab.cli import main, train_flags_config
from shardlab.errors import UserError

CPU = "--model tiny-gpt2 --dataset synthetic --device cpu --precision fp32 --seq-len 32 --micro-batch 2"


def write(tmp_path, text: str):
    path = tmp_path / "cells.txt"
    path.write_text(text)
    return path


def test_each_line_is_a_cell_with_its_timeout_environment_and_the_flags_as_train_reads_them(tmp_path):
    path = write(tmp_path, "# a comment\n\nz3 300 A=1 B=x=y --strategy zero3 --gpus 2  # trailing comment\n"
                           "dp 90 --strategy dp --set strategy_options.pin_memory=false\n")
    z3, dp = read_cells_file(path, train_flags_config, CPU.split(), repeats=3)
    assert (z3.label, z3.timeout, z3.env, z3.repeats) == ("z3", 300.0, {"A": "1", "B": "x=y"}, 3)
    assert z3.config["strategy"] == "zero3" and z3.config["gpus"] == 2 and z3.config["model"] == "tiny-gpt2"
    assert z3.config["dataset"]["source"] == "synthetic" and "output_dir" not in z3.config
    assert (dp.timeout, dp.env, dp.config["strategy_options"]) == (90.0, {}, {"pin_memory": False})
    assert "gpus" not in dp.config  # only what was given: the run decides the rest, as `shardlab train` would


@pytest.mark.parametrize("text, says", [
    ("z3 --strategy zero3\n", "timeout '--strategy' is not a number"),
    ("z3\n", "starts with a label and a timeout"),
    ("a 10 --strategy dp\na 10 --strategy zero2\n", "label 'a' is used twice"),
    ("a 10 --strategy dp --no-such-flag\n", "cells.txt:1: unrecognized arguments: --no-such-flag"),
    ("a 10 --strategy zero9\n", "cells.txt:1:"),
    ("# nothing\n", "has no cell lines"),
])
def test_a_bad_line_is_refused_naming_the_file_and_line(tmp_path, text, says):
    with pytest.raises(UserError) as err:
        read_cells_file(write(tmp_path, text), train_flags_config, CPU.split())
    assert says in str(err.value)


def test_the_matrix_flags_are_refused_with_cells_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "a 10 --strategy dp\n")
    assert main(["bench", "--cells", str(path), "--strategies", "dp,zero2", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--strategies would be ignored" in err
    assert not (tmp_path / "b").exists()


def test_the_runner_gives_each_cell_its_environment_and_its_own_timeout(tmp_path, monkeypatch):
    # The stand-in prints the variable and sleeps as long as SLEEP says: the first cell ends (no summary.json: failed
    # as "no summary"), the second outlives its own 1 s limit although the bench's default is an hour.
    stand_in = "import os, sys, time; print('VAR', os.environ.get('VAR')); time.sleep(float(os.environ['SLEEP']))"
    monkeypatch.setattr(runner, "SHARDLAB_COMMAND", (sys.executable, "-c", stand_in))
    path = write(tmp_path, "quick 60 VAR=hello SLEEP=0 --strategy dp\nslow 1 SLEEP=30 --strategy dp\n")
    cells = read_cells_file(path, train_flags_config, CPU.split())
    state = bench(["cells:cells.txt"], tmp_path / "b", cells=cells, report=False, echo=lambda _: None)
    quick, slow = state["cells"]
    assert quick["env"] == {"VAR": "hello", "SLEEP": "0"}
    assert quick["repeats"][0]["kind"] == "no summary"
    assert "VAR hello" in (tmp_path / "b" / quick["repeats"][0]["log"]).read_text()
    assert slow["repeats"][0]["exit_code"] == "timeout" and slow["repeats"][0]["reason"] == "timed out after 1 s"
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["suites"] == ["cells:cells.txt"]


def test_a_run_too_short_for_a_warm_up_says_its_rate_includes_it(tmp_path):
    """A run of WARMUP_STEPS steps or fewer has no steady state to time: its rate is the median of every step, compile
    included (a three-step zero3 --compile run printed 2,698 tok/s while its third step ran at 51,185). The runner's
    line says so; a longer run's line does not."""
    from shardlab.measure.summary import RunSummary

    short, long = tmp_path / "short", tmp_path / "long"
    for d, excluded, timed in ((short, 0, 3), (long, 3, 17)):
        d.mkdir()
        RunSummary.from_dict({"useful_tokens_per_s": 2698.4, "warmup_steps_excluded": excluded, "timed_steps": timed}).write(d)
    assert runner._brief(short).startswith("2,698 useful tok/s (all 3 steps, warm-up included)")
    assert runner._brief(long) == "2,698 useful tok/s"
