"""The README is a short manual: at most 200 lines, its links resolve, its two set-up commands exist, and every
headline figure equals its line in benchmarks/RESULTS.md (which links the dated page of runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| claim")]


def test_readme_is_short_and_its_headline_figures_equal_results_md():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    results = {}
    for cells in _rows((ROOT / "benchmarks" / "RESULTS.md").read_text()):
        m = re.match(r'<a id="([^"]+)"></a>(.*)', cells[0])
        if m:
            assert re.search(r"\]\(results/[^)]+\)", cells[-1]), f"RESULTS.md line {m.group(1)} links no dated page"
            results[m.group(1)] = (m.group(2).strip(), cells[1])
    headline = readme.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    quoted = 0
    for cells in _rows(headline):
        if set(cells[0]) <= {"-"}:
            continue
        m = re.fullmatch(r"\[(.+)\]\(benchmarks/RESULTS\.md#([\w-]+)\)", cells[1])
        assert m, f"a README headline figure must link its RESULTS.md line: {cells}"
        figure, anchor = m.groups()
        assert anchor in results, anchor
        assert (cells[0], figure) == results[anchor], f"README and RESULTS.md differ on {anchor}"
        quoted += 1
    assert quoted >= 8


def test_readme_links_resolve_and_its_setup_commands_exist():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if not re.match(r"[a-z]+:", target):
            assert (ROOT / target).exists(), target
    makefile = (ROOT / "Makefile").read_text()
    for command in ("make demo", "make test"):
        assert f"    {command} " in readme, command
        assert re.search(rf"^{command.split()[1]}:", makefile, re.M), command
    assert re.search(r"^docs:", makefile, re.M)


@pytest.mark.parametrize("path", ["benchmarks/RESULTS.md", "CHANGELOG.md"])
def test_results_and_changelog_links_resolve(path):
    text = (ROOT / path).read_text()
    base = (ROOT / path).parent
    for target in re.findall(r"(?<!!)\[[^\]\n]+\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:", target):
            assert (base / target).exists(), f"{path}: {target}"
