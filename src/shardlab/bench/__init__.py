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

from .machine import check_cells
from .matrix import Cell, Overrides, builtin_suites, expand, load_suite
from .runner import BENCH_FILE, run_bench, run_order
from ..report import write_report


def plan_cells(suites: list[str], overrides: Overrides | None = None, left_out: list[str] | None = None) -> list[Cell]:
    """The cells the suites expand to (nothing runs); axis combinations a strategy cannot run go to ``left_out``."""
    return expand([load_suite(s) for s in suites], overrides, left_out)


def interleaved(suites: list[str]) -> bool:
    """Whether any of the suites asks for interleaved repeats."""
    return any(load_suite(s).interleave for s in suites)


def bench(suites: list[str], output_dir: str | Path, overrides: Overrides | None = None, *, timeout: float = 3600.0,
          rerun: bool = False, report: bool = True, interleave: bool | None = None, budget_s: float | None = None,
          cells: list[Cell] | None = None, echo=print) -> dict[str, Any]:
    """Run the suites' cells into ``output_dir``; write the report into ``output_dir/report`` unless told not to.

    Before any run starts, what this machine cannot run is refused in one line (``machine.check_cells``: a GPU count
    above its GPUs, a model of a model axis that is unknown or not available offline). ``interleave``: repeats
    round-robin over the cells (default: as the suites say). ``budget_s``: start no run after that many seconds.
    ``cells``: run these (a cells file's, bench/cellfile.py) instead of the suites' matrix; ``suites`` then only names
    them in bench.json."""
    if cells is None:
        cells = plan_cells(suites, overrides)
        if interleave is None:
            interleave = interleaved(suites)
    check_cells(cells)
    state = run_bench(cells, output_dir, suites=suites, timeout=timeout, rerun=rerun, interleave=bool(interleave),
                      budget_s=budget_s, echo=echo)
    if report:
        written = write_report([Path(output_dir)], Path(output_dir) / "report")
        echo(f"[bench] report: {written['markdown']} and {written['html']}")
    return state


__all__ = ["bench", "plan_cells", "interleaved", "check_cells", "Overrides", "Cell", "builtin_suites", "load_suite", "expand",
           "run_bench", "run_order", "BENCH_FILE"]
