"""Read what runs left on disk: bench directories (bench.json) and run directories (summary.json).

Nothing here trains or imports an engine. Repeats of one configuration become one ``Cell`` whose
figures are medians with a min-max spread; failed runs stay in the cell with their reason.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from ..config import config_from_dict
from ..dotted import get_dotted
from ..errors import UserError
from ..specs.registry import DEFAULT_STRATEGY
from ..measure.records import read_jsonl
from ..measure.summary import RunSummary

BENCH_FILE = "bench.json"


@dataclass
class Run:
    """One finished run directory."""

    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    record: RunSummary | None = None  # summary, typed (read_run gives it; built from `summary` when not)

    @cached_property
    def typed(self) -> RunSummary:
        """The summary as a RunSummary: the monitor's statistics and other typed fields."""
        return self.record if self.record is not None else RunSummary.from_dict(self.summary)

    @cached_property
    def env(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "env.json").read_text())
        except (OSError, ValueError):
            return {}

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "metrics.jsonl")  # a line cut short by a killed run is skipped

    def _csv(self, name: str) -> list[dict[str, str]]:
        path = self.path / name
        if not path.is_file():
            return []
        with open(path, newline="") as f:
            return list(csv.DictReader(f))

    @cached_property
    def gpu_samples(self) -> list[dict[str, str]]:
        return self._csv("gpu_memory.csv")

    @cached_property
    def cpu_samples(self) -> list[dict[str, str]]:
        return self._csv("cpu_memory.csv")


@dataclass
class Spread:
    median: float
    low: float
    high: float
    n: int


def spread(values: list[float | None]) -> Spread | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class Cell:
    """One configuration: its successful repeats and its failures."""

    label: str
    config: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # "suite/part" from bench.json; empty for plain run dirs
    source: str = ""
    planned: int | None = None  # repeats the bench planned (bench.json); None for plain run dirs

    @property
    def ok(self) -> bool:
        return bool(self.runs)

    @property
    def repeats(self) -> int:
        return len(self.runs) + len([f for f in self.failures if f.get("status") == "failed"])

    def in_part(self, name: str) -> bool:
        """Part membership from bench.json; cells without it (plain run dirs) belong to every table."""
        return not self.parts or any(p.split("/")[-1] == name for p in self.parts)

    # ---- figures --------------------------------------------------------------------------------
    def values(self, getter) -> list[Any]:
        out = []
        for r in self.runs:
            try:
                out.append(getter(r))
            except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):  # a figure the run lacks
                out.append(None)
        return out

    def stat(self, key_or_getter) -> Spread | None:
        getter = key_or_getter if callable(key_or_getter) else (lambda r, k=key_or_getter: r.summary.get(k))
        return spread(self.values(getter))

    def first(self, key: str, default: Any = None) -> Any:
        for r in self.runs:
            if r.summary.get(key) is not None:
                return r.summary[key]
        return default

    # ---- what the run was ----------------------------------------------------------------------
    def setting(self, dotted: str, default: Any = None) -> Any:
        return get_dotted(self.config, dotted, default)

    @property
    def strategy(self) -> str:
        return self.first("strategy") or self.setting("strategy", DEFAULT_STRATEGY)

    @property
    def model(self) -> str:
        return self.first("model") or self.setting("model", "?")

    @property
    def world(self) -> int:
        w = self.first("world_size")
        if w is None:
            w = (self.setting("gpus") or 1) * (self.setting("nodes") or 1)
        return int(w)

    @property
    def device_type(self) -> str:
        return self.first("device_type") or self.setting("device", "?")

    @property
    def pinned(self) -> bool:
        return bool(self.setting("strategy_options.pin_memory", True))

    def footing(self) -> dict[str, Any]:
        """What must agree between compared runs: precision, batch (global and per GPU), sequence, steps, tokens."""
        s = self.runs[0].summary if self.runs else {}
        glob = s.get("global_batch", self.setting("global_batch"))
        seq = s.get("seq_len", self.setting("seq_len"))
        steps = s.get("steps", self.setting("max_steps"))
        return {
            "precision": s.get("precision", self.setting("precision")),
            "global_batch": glob,
            "micro_batch": s.get("micro_batch", self.setting("micro_batch")),
            "seq_len": seq,
            "steps": steps,
            "tokens": glob * seq * steps if glob and seq and steps else None,
        }


# --------------------------------------------------------------------------------------------------


def read_run(path: Path) -> Run | None:
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        return None
    try:
        summary = RunSummary.read(path)
    except (OSError, ValueError):
        return None
    return Run(path, summary.to_dict(), _read_config(path / "config.yaml"), summary)


def _read_config(path: Path) -> dict[str, Any]:
    """A bench cell's config file, every field filled in: the file holds what the cell gave (config.dump_config's
    given_only, so that `shardlab train --config` leaves the rest to shardlab), the report wants each value."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(data, dict):
        return {}
    try:
        return config_from_dict(data).model_dump(mode="json")
    except UserError:  # written by another shardlab version: show what it says
        return data


def _identity(config: dict[str, Any]) -> str:
    c = {k: v for k, v in config.items() if k not in ("output_dir", "resume")}
    return yaml.safe_dump(c, sort_keys=True)


def load_bench(root: Path) -> list[Cell]:
    state = json.loads((root / BENCH_FILE).read_text())
    cells = []
    for entry in state.get("cells", []):
        config = _read_config(root / entry["config"]) if entry.get("config") else {}
        cell = Cell(label=entry["label"], config=config, parts=list(entry.get("parts", [])), source=str(root),
                    planned=entry.get("repeats_planned"))
        for rec in entry.get("repeats", []):
            run = read_run(root / rec["run_dir"]) if rec.get("status") == "ok" and rec.get("run_dir") else None
            if run is not None:
                cell.runs.append(run)
            else:
                status = "skipped" if rec.get("status") == "skipped" else "failed"
                cell.failures.append({**rec, "status": status, "reason": rec.get("reason") or "its summary.json is missing"})
        missing = int(entry.get("repeats_planned", 1)) - len(entry.get("repeats", []))
        if missing > 0 and not cell.runs and not cell.failures:  # the bench was stopped (time limit, Ctrl-C) before it
            cell.failures.append({"status": "failed", "kind": "not finished",
                                  "reason": "the bench stopped before this cell ended; run the same `shardlab bench` again to finish it"})
        if cell.runs:  # the resolved config the trainer wrote (batch triple filled in), as for loose run dirs
            cell.config = cell.runs[0].config
        cells.append(cell)
    return cells


def load(paths: list[str | Path]) -> list[Cell]:
    """Cells from bench directories and run directories (repeats of one config grouped into one cell)."""
    cells: list[Cell] = []
    loose: dict[str, Cell] = {}
    for raw in paths:
        path = Path(raw)
        if (path / BENCH_FILE).is_file():
            cells.extend(load_bench(path))
            continue
        if (path / "summary.json").is_file() or (path / "config.yaml").is_file():
            run = read_run(path)
            config = run.config if run else _read_config(path / "config.yaml")
            key = _identity(config)
            cell = loose.get(key)
            if cell is None:
                name = f"{path.parent.name}-{path.name}" if re.fullmatch(r"r\d+", path.name) else path.name
                cell = loose[key] = Cell(label=name, config=config, source=str(path))
                cells.append(cell)
            if run is not None:
                cell.runs.append(run)
            else:
                cell.failures.append({"status": "failed", "run_dir": str(path), "reason": "no summary.json (the run did not finish)"})
            continue
        if path.is_dir():
            raise UserError(f"{str(path)!r} is neither a bench directory (bench.json) nor a run directory (summary.json)",
                            "pass the directory `shardlab bench` or `shardlab train --output-dir` wrote")
        raise UserError(f"{str(path)!r} does not exist", "check the path")
    _unique_labels(cells)
    return cells


def _unique_labels(cells: list[Cell]) -> None:
    seen: dict[str, int] = {}
    for c in cells:
        if c.label in seen:
            seen[c.label] += 1
            c.label = f"{c.label}-{seen[c.label]}"
        else:
            seen[c.label] = 1


__all__ = ["Run", "Cell", "Spread", "spread", "load", "load_bench", "read_run"]
