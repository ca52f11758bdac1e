"""Comments say why, not when: no dates and no issue numbers in src/ or the README.

The rule and its reason belong in a comment or docstring; when it was measured, in which issue and on which dated
results page belong to CHANGELOG.md and benchmarks/results/. `python tools/why_not_when.py` rewrites what this test
finds (and moves the old lines to CHANGELOG.md).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r"20\d\d-\d\d-\d\d|issue \d+")


def test_no_dates_or_issue_numbers_in_src_and_readme():
    files = [*sorted((ROOT / "src").rglob("*.py")), ROOT / "README.md"]
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for path in files
            for n, line in enumerate(path.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert not hits, "dates or issue numbers (run python tools/why_not_when.py):\n" + "\n".join(hits)
