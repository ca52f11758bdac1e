"""`--help` speaks the user's words: metavars named after the value, every default stated, `plan`'s own flags first."""

from __future__ import annotations

import re

import pytest

from shardlab.cli import FLAGS, build_parser
from shardlab.config import RunConfig


def _help(capsys, monkeypatch, *command: str) -> str:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: argparse wraps at the terminal width
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _flag_lines(text: str) -> dict[str, str]:
    """Each option's entry as one line (argparse puts the help of a long invocation on the next line)."""
    joined = re.sub(r"\n {3,}", " ", text)
    return {m.group(1): m.group(0) for m in re.finditer(r"^  (--[\w-]+)(?:, --no-[\w-]+)?.*$", joined, re.M)}


def test_train_metavars_name_the_value_not_the_config_path(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "train")
    assert "__" not in text  # argparse's dest-derived DATASET__SOURCE
    lines = _flag_lines(text)
    assert lines["--dataset"].startswith("  --dataset SOURCE ")
    assert lines["--format"].startswith("  --format {lm,qa} ")  # a Literal shows its choices
    assert lines["--micro-batch"].startswith("  --micro-batch N|auto ")
    assert lines["--stages"].startswith("  --stages STAGES ")
    assert lines["--microbatches"].startswith("  --microbatches MICROBATCHES ")  # shares grad_accum with --grad-accum


def test_every_train_flag_states_its_default(capsys, monkeypatch):
    lines = _flag_lines(_help(capsys, monkeypatch, "train"))
    missing = [flag for flag, *_ in FLAGS if "default" not in lines[flag]]
    assert not missing, missing
    assert lines["--seq-len"].endswith(f"(default: {RunConfig.model_fields['seq_len'].default})")
    assert lines["--lr-schedule"].endswith(f"(default: {RunConfig.model_fields['lr_schedule'].default})")
    assert lines["--pin-memory"].endswith("(default: on)") and lines["--compile"].endswith("(default: off)")
    assert lines["--dataset"].endswith("(default: offline)")  # a nested key's default (DatasetConfig.source)


def test_plan_help_describes_itself_and_lists_its_own_flags_first(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "plan")
    assert "recommend the fastest strategy that fits" in text and "Needs no GPU" in text
    own = [text.index(f"\n  {flag}") for flag in ("--gpu-memory-gb", "--host-ram-gb", "--nvme-free-gb", "--json")]
    assert own == sorted(own) and max(own) < text.index("\n  --model ")
    assert "(default: not checked)" in _flag_lines(text)["--nvme-free-gb"]


@pytest.mark.parametrize("command", [("bench",), ("report",), ("slurm",), ("export",), ("pipeline", "simulate"), ("plan",), ("train",)])
def test_help_shows_real_defaults_and_never_none(capsys, monkeypatch, command):
    text = _help(capsys, monkeypatch, *command)
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text


def test_a_real_default_is_shown_by_the_formatter(capsys, monkeypatch):
    assert _flag_lines(_help(capsys, monkeypatch, "bench"))["--cell-timeout"].endswith("(default: 3600.0)")


def test_flags_are_the_config_fields_own(capsys, monkeypatch):
    """One source: each flag's help is its config field's description (config.cli names the flag), so the YAML key
    and the flag cannot drift apart; a field that names no flag gets none (it stays a --set key)."""
    from shardlab.cli import _field

    for flag, key, _, text in FLAGS:
        meta = _field(key).json_schema_extra["cli"]
        assert text == (_field(key).description if flag == meta["flag"] else meta["also"][flag]), flag
    lines = _flag_lines(_help(capsys, monkeypatch, "train"))
    assert "Twin-Flow" in lines["--offload-ratio"]  # the description's words, not a second text
    assert "10% gradient columns" in lines["--zenflow"]  # a literal % survives argparse's formatting
    assert "--compile-scope" not in lines and RunConfig.model_fields["compile_scope"].json_schema_extra is None
