"""`shardlab bench`: a matrix of `shardlab train` runs (strategies x models x micro batch x GPUs x options).

    from shardlab.bench import bench
    state = bench(["quick"], "runs/bench-quick")          # then: shardlab report runs/bench-quick

Suites (YAML under shardlab/bench/suites/) describe the matrix; ``matrix.expand`` turns them into
cells on equal footing, ``runner.run_bench`` runs each repeat in a fresh process, and the report
(``shardlab.report``) reads only the run directories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .matrix import Cell, Overrides, builtin_suites, expand, load_suite
from .runner import BENCH_FILE, run_bench
from ..report import write_report


def plan_cells(suites: list[str], overrides: Overrides | None = None) -> list[Cell]:
    """The cells the suites expand to (nothing runs)."""
    return expand([load_suite(s) for s in suites], overrides)


def bench(suites: list[str], output_dir: str | Path, overrides: Overrides | None = None, *, timeout: float = 3600.0,
          rerun: bool = False, report: bool = True, echo=print) -> dict[str, Any]:
    """Run the suites' cells into ``output_dir``; write the report into ``output_dir/report`` unless told not to."""
    cells = plan_cells(suites, overrides)
    state = run_bench(cells, output_dir, suites=suites, timeout=timeout, rerun=rerun, echo=echo)
    if report:
        written = write_report([Path(output_dir)], Path(output_dir) / "report")
        echo(f"[bench] report: {written['markdown']} and {written['html']}")
    return state


__all__ = ["bench", "plan_cells", "Overrides", "Cell", "builtin_suites", "load_suite", "expand", "run_bench", "BENCH_FILE"]
