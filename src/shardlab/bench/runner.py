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
from ..launch.procgroup import run_group
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


def run_one(cell: Cell, repeat: int, bench_dir: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    run_dir = bench_dir / "runs" / cell.label / f"r{repeat}"
    log = bench_dir / "logs" / f"{cell.label}-r{repeat}.log"
    cfg_file = bench_dir / "cells" / f"{cell.label}.yaml"
    record: dict[str, Any] = {"repeat": repeat, "run_dir": _relative(run_dir, bench_dir), "log": _relative(log, bench_dir)}
    if (run_dir / "summary.json").is_file() and _same_config(run_dir, cell):
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
        run = run_group(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, grace=15)
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
    if s.gpu_mem_peak_gib is not None:
        parts.append(f"peak {s.gpu_mem_peak_gib:.1f} GiB")
    cpu = s.cpu_monitor.real_mb if s.cpu_monitor is not None else None
    if cpu is not None and cpu.peak:
        parts.append(f"tree RSS {cpu.peak / 1e3:.2f} GB")
    if s.final_train_loss is not None:
        parts.append(f"loss {s.final_train_loss:.3f}")
    return ", ".join(parts)


def run_bench(cells: list[Cell], bench_dir: str | Path, *, suites: list[str], timeout: float = 3600.0,
              rerun: bool = False, echo=print) -> dict[str, Any]:
    """Run every repeat of every cell; bench.json is rewritten after each, so a cut-short bench keeps its results."""
    root = Path(bench_dir)
    (root / "cells").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    state: dict[str, Any] = {
        "shardlab_bench": 1,
        "suites": suites,
        "started": datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "cells": [],
    }
    for cell in cells:
        cfg = cell.run_config(root / "runs" / cell.label / "rK")
        (root / "cells" / f"{cell.label}.yaml").write_text(dump_config(cfg, given_only=True))
        state["cells"].append({"label": cell.label, "parts": cell.parts, "differs": cell.differs, "repeats_planned": cell.repeats,
                               "footing": footing(cell.config), "config": f"cells/{cell.label}.yaml", "repeats": []})
    _save(root, state)
    total = sum(c.repeats for c in cells)
    done = 0
    for cell, entry in zip(cells, state["cells"]):
        for k in range(1, cell.repeats + 1):
            done += 1
            prefix = f"[bench {done}/{total}] {cell.label} r{k}"
            if rerun:
                shutil.rmtree(root / "runs" / cell.label / f"r{k}", ignore_errors=True)
            if entry["repeats"] and entry["repeats"][-1]["status"] == "failed":
                entry["repeats"].append({"repeat": k, "status": "skipped", "reason": "an earlier repeat of this cell failed"})
                echo(f"{prefix}: skipped (an earlier repeat failed)")
                continue
            echo(f"{prefix}: running ...")
            rec = run_one(cell, k, root, timeout, env)
            entry["repeats"].append(rec)
            _save(root, state)
            if rec["status"] == "ok":
                kept = " (kept from an earlier bench)" if rec.get("kept") else f" in {rec['wall_s']:.0f} s"
                echo(f"{prefix}: ok{kept}: {_brief(root / rec['run_dir'])}")
            else:
                echo(f"{prefix}: FAILED ({rec['kind']}, exit {rec['exit_code']}): {rec['reason']}  [log: {rec['log']}]")
    state["finished"] = datetime.now().isoformat(timespec="seconds")
    _save(root, state)
    return state


def _save(root: Path, state: dict[str, Any]) -> None:
    tmp = root / (BENCH_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(root / BENCH_FILE)


__all__ = ["run_bench", "run_one", "failure_reason", "BENCH_FILE"]
