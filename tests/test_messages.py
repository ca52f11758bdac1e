"""shardlab.messages: the '[shardlab] ...' lines, rank 0's only, at the level --log-level / --quiet set for the command
and the workers it starts."""

from __future__ import annotations

import pytest

from shardlab import messages
from shardlab.cli import build_parser


@pytest.fixture(autouse=True)
def _level():
    with messages.at_level(None):  # this process' level and SHARDLAB_LOG_LEVEL given back after each test
        yield


def test_info_lines_are_rank_zeros_and_follow_the_level(capsys, monkeypatch):
    messages.configure("info")
    messages.info("one")
    assert capsys.readouterr().out == "[shardlab] one\n"
    monkeypatch.setenv("RANK", "1")  # another rank says nothing but its warnings
    messages.info("two")
    messages.warning("three")
    assert capsys.readouterr().out == "[shardlab] three\n"
    monkeypatch.setenv("RANK", "0")
    messages.configure("warning")
    messages.info("four")
    assert capsys.readouterr().out == "" and not messages.shows("info")


def test_the_level_reaches_the_workers_through_the_environment(monkeypatch):
    import os

    messages.configure("error")
    assert os.environ[messages.LEVEL_ENV] == "error"  # a spawned worker's configure(None) reads it
    messages.configure(None)
    assert not messages.shows("warning") and messages.shows("error")


@pytest.mark.parametrize("argv", [["train"], ["plan"], ["bench"], ["pipeline", "simulate"], ["report", "x"]])
def test_every_command_takes_log_level_and_quiet(argv):
    args = build_parser().parse_args([*argv, "--log-level", "debug", "--quiet"])
    assert args.log_level == "debug" and args.quiet


def test_a_command_in_process_gives_the_level_and_its_variable_back(monkeypatch):
    import os

    from shardlab.cli import main

    monkeypatch.delenv(messages.LEVEL_ENV, raising=False)
    before = messages.LOGGER.level
    assert main(["pipeline", "simulate", "--quiet", "--stages", "2", "--microbatches", "4"]) == 0
    assert messages.LEVEL_ENV not in os.environ and messages.LOGGER.level == before
