"""The generated references of the docs are complete.

Each check compares the generator (tools/docs/reference.py) with the code it reads, found another way: a flag, config
key, summary.json field or user error without an entry fails here, naming it. In-process, no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "docs"))

import reference  # noqa: E402

from shardlab.cli import build_parser  # noqa: E402
from shardlab.config import RunConfig  # noqa: E402
from shardlab.measure import summary, summary_fields  # noqa: E402


# ---- commands and flags --------------------------------------------------------------------------


def _all_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_options(sub, path + (name,))
        elif not isinstance(action, argparse._HelpAction):
            for name in action.option_strings or [action.dest]:
                yield " ".join(path), name


def test_every_command_and_flag_has_an_entry_with_its_default():
    page = reference.cli_page()
    entries = {(e.command, f): e for e in reference.cli_entries() for f in e.flags}
    missing = [(c, f) for c, f in _all_options(build_parser()) if (c, f) not in entries]
    assert not missing, f"flags without an entry in the CLI reference: {missing}"
    commands = {c for c, _ in _all_options(build_parser())}
    assert commands == {"train", "plan", "pipeline simulate", "bench", "report", "slurm", "export", "generate"}
    for c in commands:
        assert f"## shardlab {c} " in page, c
    for e in entries.values():
        assert e.default, e
        assert f'id="{e.anchor}"' in page or e.run_flag, e  # run flags are listed once, under train
        assert f"`{e.flags[0]}`" in page, e
    # the defaults are the real ones
    assert entries[("train", "--seq-len")].default == "128"
    assert entries[("train", "--strategy")].default == RunConfig.model_fields["strategy"].default
    assert entries[("pipeline simulate", "--stages")].default == "4"
    assert entries[("bench", "--cell-timeout")].default == "3600.0"


# ---- config keys ---------------------------------------------------------------------------------


def _schema_keys(schema: dict, defs: dict, prefix: str = "") -> set[str]:
    out = set()
    for name, prop in schema.get("properties", {}).items():
        out.add(prefix + name)
        ref = prop.get("$ref") or next((a.get("$ref") for a in prop.get("anyOf", []) if "$ref" in a), None)
        items = prop.get("items") or next((a.get("items") for a in prop.get("anyOf", []) if "items" in a), None)
        if ref:
            out |= _schema_keys(defs[ref.split("/")[-1]], defs, prefix + name + ".")
        elif items and "$ref" in items:
            out |= _schema_keys(defs[items["$ref"].split("/")[-1]], defs, prefix + name + "[].")
    return out


def test_every_config_key_has_an_entry_with_type_default_and_meaning():
    schema = RunConfig.model_json_schema()
    keys = _schema_keys(schema, schema.get("$defs", {}))
    entries = {k.key: k for k in reference.config_entries()}
    assert keys - set(entries) == set(), f"config keys without an entry: {sorted(keys - set(entries))}"
    assert set(entries) - keys == set()
    undocumented = [k for k, e in entries.items() if not e.description]
    assert not undocumented, f"config keys without a description (Field(description=...) in config.py): {undocumented}"
    page = reference.config_page()
    for k in entries.values():
        assert k.type and (k.default or k.type == "section"), k
        assert f'id="{k.anchor}"' in page and f"`{k.key}`" in page, k
    assert entries["seq_len"].default == "128" and entries["seq_len"].flag == "--seq-len"
    assert entries["strategy_options.pin_memory"].default == "on"


# ---- summary.json fields -------------------------------------------------------------------------


def _record_keys(cls, prefix="") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        if f.name == "extras":
            continue
        out.add(prefix + f.name)
        nested = cls._nested.get(f.name)
        if nested is not None and nested is not summary.Stat:
            sep = "[]." if "list[" in str(f.type) else "."
            out |= _record_keys(nested, prefix + f.name + sep)
    return out


def test_every_summary_field_has_an_entry_and_a_meaning():
    fields = _record_keys(summary.RunSummary)
    documented = {k for k in summary_fields.FIELDS if not k.startswith("*.")}
    assert fields - documented == set(), f"summary.json fields without a line in measure/summary_fields.py: {sorted(fields - documented)}"
    assert documented - fields == set(), f"lines for fields that do not exist: {sorted(documented - fields)}"
    page = reference.summary_page()
    for f in reference.summary_entries():
        assert f.description, f
        assert f'id="{f.anchor}"' in page, f
    assert 'id="gpu_mem_peak_gib"' in page
    stat_fields = {f.name for f in dataclasses.fields(summary.Stat)} - {"extras"}
    assert {f"*.{n}" for n in stat_fields} <= set(summary_fields.FIELDS)


def test_every_key_of_the_committed_summaries_is_documented():
    known = set(summary_fields.FIELDS) | set(summary_fields.EXTRAS)
    files = list((ROOT / "benchmarks" / "results").rglob("summary.json")) + list((ROOT / "tests").rglob("summary.json"))
    assert files
    unknown = {}
    for path in files:
        for key in json.loads(path.read_text()):
            if key not in known:
                unknown.setdefault(key, path.relative_to(ROOT))
    assert not unknown, f"summary.json keys without an entry (summary_fields.EXTRAS or a RunSummary field): {unknown}"


# ---- user errors ---------------------------------------------------------------------------------


def test_every_user_error_has_an_entry_with_cause_and_fix():
    entries = reference.error_entries()
    classes = {e.kind for e in entries} | {"UserError"}
    # found again with a plain text search: calls of UserError and its subclasses, not class statements or catches
    call = re.compile(r"(?<![\w.])(?:errors\.)?(" + "|".join(sorted(classes)) + r")\(")
    sites = []
    for path in sorted((ROOT / "src" / "shardlab").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.match(r"\s*class ", code):
                continue
            sites += [(str(path.relative_to(ROOT / "src")), n) for _ in call.finditer(code)]
    found = {(e.path, e.line) for e in entries}
    missing = [s for s in sites if s not in found]
    assert not missing, f"UserError calls without a catalogue entry: {missing}"
    assert len(entries) >= len(sites) >= 150
    for e in entries:
        assert e.cause and e.fix, e
    page = reference.errors_page()
    assert all(f'id="{e.anchor}"' in page for e in entries)
    assert len({e.anchor for e in entries}) == len(entries)
    for title, phrase, _ in reference.COMMON_ERRORS:
        assert any(phrase.lower() in e.cause.lower() for e in entries), (title, phrase)
    assert len(reference.COMMON_ERRORS) == 5
