"""`shardlab bench` and `shardlab report`: argument parsing in front of the library calls."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ..config import parse_set
from ..errors import UserError
from . import Overrides, bench, builtin_suites, check_cells, interleaved, load_suite, plan_cells, run_order
from ..report import write_report
from .cellfile import read_cells_file
from .matrix import footing


def _csv_list(typ):
    def parse(text: str) -> list:
        try:
            return [typ(t.strip()) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {typ.__name__}") from None

    return parse


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="run a matrix of training runs (strategies x models x micro batch x GPUs x options) "
                                     "and write the report", description="Each cell is a fresh `shardlab train` process with its own "
                                     "run directory under --output-dir; failing cells are recorded and the matrix goes on.")
    b.add_argument("--suite", action="append", default=[], metavar="NAME|FILE",
                   help="built-in suite (quick, strategies, pin-memory, offload, weak-scaling, strong-scaling, scaling, "
                        "big-model, adapters) or a suite YAML; repeat to run several into one bench (shared cells run once). Default: quick")
    b.add_argument("--cells", metavar="FILE", default=None,
                   help="run the `shardlab train` lines of FILE instead of a suite's matrix, one cell each: "
                        "'<label> <timeout_s> [VAR=value ...] <train flags>' (bench/cellfile.py)")
    b.add_argument("--cell-flags", default=None, metavar="FLAGS",
                   help="with --cells: `shardlab train` flags added to every line (default: none)")
    b.add_argument("--output-dir", "-o", default=None, help="bench directory (default: runs/bench-SUITE)")
    b.add_argument("--repeats", type=int, default=None, help="runs per cell (medians and min-max in the report)")
    b.add_argument("--models", type=_csv_list(str), default=None, help="models axis, e.g. gpt2-medium,bloom-560m")
    b.add_argument("--strategies", type=_csv_list(str), default=None, help="strategies axis, e.g. dp,zero2,fsdp")
    b.add_argument("--gpus", "--gpu-counts", dest="gpus", type=_csv_list(int), default=None,
                   help="GPU-count axis, e.g. 1,2,4 (worker processes on CPU); at most the GPUs this machine has")
    b.add_argument("--micro-batch", type=_csv_list(int), default=None, help="micro-batch axis, e.g. 4,8")
    b.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run")
    b.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    b.add_argument("--precision", default=None, help="precision of every cell except those whose point is another one")
    b.add_argument("--device", default=None, help="auto, cuda or cpu")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any RunConfig key for every cell")
    b.add_argument("--axis", action="append", default=[], metavar="KEY=V1,V2",
                   help="any RunConfig key as an axis of the matrix, e.g. --axis strategy_options.pin_memory=true,false "
                        "or --axis compile=false,true (replaces that axis in every part)")
    b.add_argument("--cell-timeout", type=float, default=3600.0, help="seconds before a run is stopped and recorded as failed")
    b.add_argument("--interleave", action="store_true", default=None,
                   help="run repeats round-robin over the cells (rep 1 of every cell, then rep 2, ...) so host drift hits all "
                        "alike (default: as the suite says; the scaling suite does)")
    b.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                   help="start no run after this many seconds; the report covers what ran, and the same command continues")
    b.add_argument("--rerun", action="store_true", help="run every repeat again (default: keep finished runs of the same config)")
    b.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    b.add_argument("--dry-run", action="store_true", help="list the cells and their configs; run nothing")
    b.add_argument("--list", action="store_true", help="list the built-in suites")


def add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="tables, plots and an HTML page from bench or run directories (never trains)")
    r.add_argument("paths", nargs="+", metavar="RUN_DIR", help="bench directories (bench.json) and/or run directories (summary.json)")
    r.add_argument("--output-dir", "-o", default=None, help="where the report goes (default: BENCH_DIR/report for one bench dir, else ./report)")


def cmd_bench(args: argparse.Namespace, to_config=None) -> None:
    """``to_config``: `shardlab train` flags -> RunConfig keys, for --cells (the train parser lives above the bench)."""
    if args.list:
        for name, path in sorted(builtin_suites().items()):
            print(f"{name:16s} {load_suite(str(path)).description}")
        return
    suites = args.suite or ["quick"]
    axes = {k: v for k, v in (("model", args.models), ("strategy", args.strategies), ("gpus", args.gpus),
                              ("micro_batch", args.micro_batch)) if v}
    base = {k: v for k, v in (("max_steps", args.max_steps), ("seq_len", args.seq_len), ("precision", args.precision),
                              ("device", args.device)) if v is not None}
    base.update(parse_set(args.set))
    for item in args.axis:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise UserError(f"--axis {item!r} is not of the form KEY=V1,V2", "write e.g. --axis strategy_options.pin_memory=true,false")
        axes[key.strip()] = [parse_set([f"v={v}"])["v"] for v in values.split(",") if v.strip()]
    if args.repeats is not None and args.repeats < 1:
        raise UserError(f"--repeats {args.repeats} must be at least 1", "pass --repeats 1 or more")
    if args.budget_s is not None and args.budget_s <= 0:
        raise UserError(f"--budget-s {args.budget_s:g} must be positive", "pass the seconds after which no run starts, e.g. --budget-s 480")
    overrides = Overrides(axes=axes, base=base, repeats=args.repeats)
    if args.cells:
        return _bench_cells(args, to_config)
    out = Path(args.output_dir or f"runs/bench-{'-'.join(Path(s).stem for s in suites)}")
    if args.dry_run:
        left_out: list[str] = []
        cells = plan_cells(suites, overrides, left_out)
        check_cells(cells)
        interleave = interleaved(suites) if args.interleave is None else True
        for c in cells:
            f = footing(c.config)
            print(f"{c.label:28s} x{c.repeats}  {', '.join(c.parts)}  precision {f['precision']}, global batch {f['global_batch']}, "
                  f"seq {f['seq_len']}, steps {f['steps']}" + (f"  (differs on purpose: {', '.join(c.differs)})" if c.differs else ""))
        for line in left_out:
            print(f"left out: {line}")
        if interleave and any(c.repeats > 1 for c in cells):
            print(f"repeats interleaved: {len(run_order(cells, True))} runs, repeat 1 of every cell first")
        return
    state = bench(suites, out, overrides, timeout=args.cell_timeout, rerun=args.rerun, report=not args.no_report,
                  interleave=args.interleave, budget_s=args.budget_s)
    _say_done(state, out)


def _say_done(state: dict, out: Path) -> None:
    failed = [c["label"] for c in state["cells"] if not any(r["status"] == "ok" for r in c["repeats"])]
    print(f"[bench] {len(state['cells']) - len(failed)} of {len(state['cells'])} cells ran"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f" -> {out}")


def _bench_cells(args: argparse.Namespace, to_config) -> None:
    """--cells FILE: the file's lines are the cells; the matrix's own flags would be ignored, so they are refused."""
    matrix = [flag for flag, given in (("--suite", args.suite), ("--models", args.models), ("--strategies", args.strategies),
                                       ("--gpus", args.gpus), ("--micro-batch", args.micro_batch), ("--axis", args.axis),
                                       ("--max-steps", args.max_steps), ("--seq-len", args.seq_len), ("--precision", args.precision),
                                       ("--device", args.device), ("--set", args.set)) if given]
    if matrix:
        raise UserError(f"--cells runs its file's lines as they stand; {', '.join(matrix)} would be ignored",
                        "put those flags in the file's lines, or in --cell-flags for every line")
    cells = read_cells_file(args.cells, to_config, shlex.split(args.cell_flags or ""), repeats=args.repeats or 1)
    name = f"cells:{Path(args.cells).name}"
    out = Path(args.output_dir or f"runs/bench-{Path(args.cells).stem}")
    if args.dry_run:
        for c in cells:
            f = footing(c.config)
            env = " ".join(f"{k}={v}" for k, v in c.env.items())
            print(f"{c.label:28s} x{c.repeats}  {c.timeout:.0f} s  precision {f['precision']}, global batch {f['global_batch']}, "
                  f"seq {f['seq_len']}, steps {f['steps']}" + (f"  env {env}" if env else ""))
        return
    state = bench([name], out, cells=cells, timeout=args.cell_timeout, rerun=args.rerun, report=not args.no_report,
                  interleave=bool(args.interleave), budget_s=args.budget_s)
    _say_done(state, out)


def cmd_report(args: argparse.Namespace) -> None:
    paths = [Path(p) for p in args.paths]
    if args.output_dir:
        out = Path(args.output_dir)
    elif len(paths) == 1 and (paths[0] / "bench.json").is_file():
        out = paths[0] / "report"
    else:
        out = Path("report")
    written = write_report(paths, out)
    print(f"report: {written['markdown']}, {written['html']}, {written['json']}, {out / 'tables'}/*.csv, {out / 'plots'}/*.png")


__all__ = ["add_bench_parser", "add_report_parser", "cmd_bench", "cmd_report"]
