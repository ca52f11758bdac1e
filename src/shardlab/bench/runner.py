"""Run the cells of a bench, each repeat a fresh `shardlab train` process with its own run directory.

    BENCH_DIR/
      bench.json            what ran: suites, cells, every repeat's status, exit code, reason, wall time
      cells/LABEL.yaml      the cell's RunConfig (what `shardlab train --config` reads)
      runs/LABEL/rK/        the run directory of repeat K (summary.json, metrics.jsonl, *_memory.csv, ...)
      logs/LABEL-rK.log     its stdout and stderr
      report/               `shardlab report BENCH_DIR` (unless --no-report)

A fresh process per run keeps peaks clean and engines' global state apart. A failing run (OOM exits
3, bad input 2, an engine crash anything else, a hang the timeout) is recorded with the last error
line of its log and the matrix goes on; the cell's remaining repeats are skipped (they would fail
the same way). A finished repeat whose config matches is kept when the same bench is run again, so
a bench cut short (a 10-minute job limit, a killed session) continues where it stopped.

Order: cell by cell (every repeat of a cell, then the next cell), or interleaved (``interleave``: repeat 1 of
every cell, then repeat 2 of every cell, ...), so that a host whose speed drifts over the bench (thermal state,
other tenants, caches) shifts every cell's repeats alike instead of one cell's. Each repeat's record in
bench.json has its place in this bench's order (``order``) and its start time. ``budget_s`` (a device call's
time limit) starts a run only when it should end within that many seconds of the bench's start, judged by the
longest earlier run of that cell, else of any cell (this bench's or, for a continued bench, the one before);
finished runs are still kept, and the same command continues the bench.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from ..config import dump_config, read_yaml
from ..runtime.procgroup import run_group
from ..measure.summary import RunSummary
from .matrix import Cell, footing

BENCH_FILE = "bench.json"
# How a cell's process starts: a fresh `python -m shardlab`. (The test suite swaps in a client of its fork server of
# pre-imported processes, tests/zygote.py, which starts an equally fresh process without importing torch again.)
SHARDLAB_COMMAND: tuple[str, ...] = (sys.executable, "-m", "shardlab")


def _relative(path: Path, root: Path) -> str:
    return str(path.relative_to(root))


def failure_reason(log_text: str, exit_code: int | str) -> str:
    """The line that says why a run failed: shardlab's `error: ...` line, else the last exception line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = re.match(r"^(\[rank \d+\] )?error: (.*)$", ln)
        if m:
            return m.group(2)
    for ln in reversed(lines):
        if re.search(r"\b\w*(Error|Exception)\b:?", ln) and not ln.startswith("File "):
            return ln
    return lines[-1] if lines else f"exit code {exit_code}, no output"


def _same_config(run_dir: Path, cell: Cell) -> bool:
    """A finished run of exactly this cell (the trainer writes the resolved config; compare resolved)."""
    try:
        written = read_yaml(run_dir / "config.yaml")
    except Exception:  # noqa: BLE001 - missing or unreadable: not a finished run of this cell
        return False
    want = yaml.safe_load(dump_config(cell.run_config(run_dir)))
    for key in ("output_dir", "micro_batch", "grad_accum", "global_batch"):
        written.pop(key, None)
        want.pop(key, None)
    return written == want


def finished(cell: Cell, repeat: int, bench_dir: Path) -> bool:
    """A finished run of this repeat of this cell is on disk (kept by a re-run of the bench)."""
    run_dir = bench_dir / "runs" / cell.label / f"r{repeat}"
    return (run_dir / "summary.json").is_file() and _same_config(run_dir, cell)


def run_order(cells: list[Cell], interleave: bool = False) -> list[tuple[int, int]]:
    """(cell index, repeat) in the order they run: cell by cell, or round-robin over the cells (repeat 1 of every
    cell, then repeat 2, ...; a cell with fewer repeats drops out of the later rounds)."""
    if not interleave:
        return [(i, k) for i, c in enumerate(cells) for k in range(1, c.repeats + 1)]
    rounds = max((c.repeats for c in cells), default=0)
    return [(i, k) for k in range(1, rounds + 1) for i, c in enumerate(cells) if k <= c.repeats]


def run_one(cell: Cell, repeat: int, bench_dir: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    run_dir = bench_dir / "runs" / cell.label / f"r{repeat}"
    log = bench_dir / "logs" / f"{cell.label}-r{repeat}.log"
    cfg_file = bench_dir / "cells" / f"{cell.label}.yaml"
    record: dict[str, Any] = {"repeat": repeat, "run_dir": _relative(run_dir, bench_dir), "log": _relative(log, bench_dir)}
    if finished(cell, repeat, bench_dir):
        return {**record, "status": "ok", "exit_code": 0, "reason": None, "kept": True}
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a stale or half-finished run of this cell
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    args = ["train", "--config", str(cfg_file), "--output-dir", str(run_dir)]
    cmd = [*SHARDLAB_COMMAND, *args]
    record["command"] = " ".join(["shardlab", *args])
    t0 = time.perf_counter()
    with open(log, "w") as out:
        # Its own session, so a timeout can end the run with every rank it spawned, and nothing else:
        # SIGTERM, 15 s for the ranks to stop, then SIGKILL.
        run = run_group(cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, **cell.env}, timeout=timeout, grace=15)
        code: int | str = "timeout" if run.timed_out else run.code
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    record["exit_code"] = code
    ok = code == 0 and (run_dir / "summary.json").is_file()
    record["status"] = "ok" if ok else "failed"
    if not ok:
        text = log.read_text(errors="replace")
        record["reason"] = f"timed out after {timeout:.0f} s" if code == "timeout" else failure_reason(text, code)
        record["kind"] = {3: "out of memory", 2: "user error", "timeout": "timeout"}.get(code, "engine error" if code else "no summary")
    else:
        record["reason"] = None
    return record


def _brief(run_dir: Path) -> str:
    s = RunSummary.read_or_none(run_dir)
    if s is None:
        return ""
    parts = [f"{s.useful_tokens_per_s or 0:,.0f} useful tok/s"]
    if s.rate_includes_warm_up:
        parts[0] += f" (all {s.timed_steps} steps, warm-up included)"
    if s.gpu_mem_peak_gib is not None:
        parts.append(f"peak {s.gpu_mem_peak_gib:.1f} GiB")
    cpu = s.cpu_monitor.real_mb if s.cpu_monitor is not None else None
    if cpu is not None and cpu.peak:
        parts.append(f"tree RSS {cpu.peak / 1e3:.2f} GB")
    if s.final_train_loss is not None:
        parts.append(f"loss {s.final_train_loss:.3f}")
    return ", ".join(parts)


def run_bench(cells: list[Cell], bench_dir: str | Path, *, suites: list[str], timeout: float = 3600.0,
              rerun: bool = False, interleave: bool = False, budget_s: float | None = None, echo=print) -> dict[str, Any]:
    """Run every repeat of every cell (cell by cell, or interleaved); bench.json is rewritten after each, so a
    cut-short bench keeps its results. With ``budget_s``, no run starts that would not end within that many seconds."""
    t_start = time.monotonic()
    root = Path(bench_dir)
    walls = _earlier_walls(root)  # label -> longest wall time of a run of that cell, seconds
    (root / "cells").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    state: dict[str, Any] = {
        "shardlab_bench": 1,
        "suites": suites,
        "started": datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "order": "interleaved" if interleave else "cell by cell",
        "walls_s": walls,  # kept across continued benches: a kept run's record has no wall time of its own
        "cells": [],
    }
    for cell in cells:
        cfg = cell.run_config(root / "runs" / cell.label / "rK")
        (root / "cells" / f"{cell.label}.yaml").write_text(dump_config(cfg, given_only=True))
        state["cells"].append({"label": cell.label, "parts": cell.parts, "differs": cell.differs, "repeats_planned": cell.repeats,
                               "footing": footing(cell.config), "config": f"cells/{cell.label}.yaml", "repeats": [],
                               **({"env": cell.env} if cell.env else {})})
    _save(root, state)
    order = run_order(cells, interleave)
    not_started = 0
    for done, (i, k) in enumerate(order, 1):
        cell, entry = cells[i], state["cells"][i]
        prefix = f"[bench {done}/{len(order)}] {cell.label} r{k}"
        if rerun:
            shutil.rmtree(root / "runs" / cell.label / f"r{k}", ignore_errors=True)
        if entry["repeats"] and entry["repeats"][-1]["status"] in ("failed", "skipped"):
            entry["repeats"].append({"repeat": k, "status": "skipped", "reason": "an earlier repeat of this cell failed"})
            echo(f"{prefix}: skipped (an earlier repeat failed)")
            continue
        expected = walls.get(cell.label, max(walls.values(), default=0.0))
        if budget_s is not None and time.monotonic() - t_start + expected > budget_s and not finished(cell, k, root):
            not_started += 1
            continue  # a shorter cell later in the order may still fit; finished runs are still kept: they cost nothing
        if not finished(cell, k, root):
            echo(f"{prefix}: running ...")
        limit = cell.timeout if cell.timeout is not None else timeout
        rec = {"order": done, "started": datetime.now().isoformat(timespec="milliseconds"), **run_one(cell, k, root, limit, env)}
        entry["repeats"].append(rec)
        if rec.get("wall_s") is not None:
            walls[cell.label] = max(walls.get(cell.label, 0.0), rec["wall_s"])
        _save(root, state)
        if rec["status"] == "ok":
            kept = " (kept from an earlier bench)" if rec.get("kept") else f" in {rec['wall_s']:.0f} s"
            echo(f"{prefix}: ok{kept}: {_brief(root / rec['run_dir'])}")
        else:
            echo(f"{prefix}: FAILED ({rec['kind']}, exit {rec['exit_code']}): {rec['reason']}  [log: {rec['log']}]")
    if not_started:
        state["budget_spent"] = {"budget_s": budget_s, "runs_not_started": not_started}
        echo(f"[bench] time budget of {budget_s:.0f} s: {not_started} of {len(order)} runs not started (they would not end "
             "within it); the same command continues the bench (finished runs are kept)")
    state["finished"] = datetime.now().isoformat(timespec="seconds")
    _save(root, state)
    return state


def _earlier_walls(root: Path) -> dict[str, float]:
    """The longest wall time of each cell's runs that an earlier bench in ``root`` recorded (bench.json), seconds."""
    try:
        earlier = json.loads((root / BENCH_FILE).read_text())
    except (OSError, ValueError):
        return {}
    walls: dict[str, float] = {k: float(v) for k, v in (earlier.get("walls_s") or {}).items()}
    for entry in earlier.get("cells", []):
        for rec in entry.get("repeats", []):
            if isinstance(rec.get("wall_s"), (int, float)):
                walls[entry["label"]] = max(walls.get(entry["label"], 0.0), float(rec["wall_s"]))
    return walls


def _save(root: Path, state: dict[str, Any]) -> None:
    tmp = root / (BENCH_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(root / BENCH_FILE)


__all__ = ["run_bench", "run_one", "run_order", "finished", "failure_reason", "BENCH_FILE"]
