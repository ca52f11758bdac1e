"""The name of a run directory in the benchmarks' tables (pipeline_vs_zero.py, pipeline_schedules.py).

A `shardlab bench` run directory, BENCH_DIR/runs/LABEL/rK, is named by its cell's label, with " rK" added when the
cell has several repeats (bench.json's repeats_planned); any other run directory by its own name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def run_name(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    bench = run_dir.parent.parent.parent / "bench.json"
    if not (re.fullmatch(r"r\d+", run_dir.name) and run_dir.parent.parent.name == "runs" and bench.is_file()):
        return run_dir.name
    label = run_dir.parent.name
    try:
        cells = json.loads(bench.read_text()).get("cells", [])
    except ValueError:
        cells = []
    planned = next((c.get("repeats_planned", 1) for c in cells if c.get("label") == label), 1)
    return label if planned == 1 else f"{label} {run_dir.name}"
