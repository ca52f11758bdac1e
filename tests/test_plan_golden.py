"""The golden plans: every preset x strategy x a few shapes (ranks, micro batch, accumulation, sequence length,
checkpointing, compile, precision, loss kernel, optimizer options, partial offload; CPU runs for the small presets),
GPU and host, every moment weighed, as tests/data/golden_plans.json holds them (tools/golden_plans.py).

A change that moves a figure is either a mistake or a decision: a decision regenerates the data in the same commit,
and the commit message says which figures moved and why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import golden_plans  # noqa: E402


def test_the_planner_gives_the_golden_plans():
    old = json.loads(golden_plans.GOLDEN.read_text())
    diff = golden_plans.differences(old, golden_plans.compute())
    shown = "\n".join(diff[:40]) + (f"\n... and {len(diff) - 40} more" if len(diff) > 40 else "")
    assert not diff, (
        f"{len(diff)} planned figures differ from tests/data/golden_plans.json (case/strategy/figure: golden -> now):\n"
        f"{shown}\nIf the change is intended, regenerate the data with `python -m tools.golden_plans --write` in the same "
        "commit, and say in its message which figures moved and why.")
