"""Bench suites: YAML data that expands into the cells (one RunConfig each) of a measurement matrix.

A suite file::

    description: what it measures
    repeats: 1                      # runs per cell (medians and min-max spread in the report)
    base: {model: gpt2-medium, seq_len: 1024, precision: bf16, ...}     # RunConfig keys of every cell
    interleave: false               # true: repeats round-robin over cells (rep 1 of every cell, then rep 2, ...)
    parts:                          # one per table the suite reproduces
      - name: strategies
        base: {}                    # RunConfig keys for this part only (e.g. a fixed global batch)
        compare: strategy           # the key compared side by side in that table
        equal: [precision, global_batch, seq_len, tokens]   # must agree between compared cells
        axes: {strategy: [dp, zero2, zero3]}                # cartesian product; `gpus: machine` = 1, 2, 4.. N GPUs here
        cells:                      # extra cells, crossed with the axes they do not set
          - {label: dp-fp32, set: {strategy: dp, precision: fp32}, differs: [precision]}

Command-line flags replace axes (``--models``, ``--strategies``, ``--gpus``, ``--micro-batch``) or
set base keys (``--max-steps``, ``--precision``, ``--device``, ``--set k=v``); a key an extra cell
sets itself is kept, since that difference is the cell's point. Before anything runs, cells that a
part compares must agree on its ``equal`` keys unless a cell names the key in ``differs``: the
bench puts runs on equal footing, and says so when it deliberately does not. A combination of the
axes that the strategy's spec says it cannot run (``compile: true`` where ``supports_compile`` is
false) is left out of the matrix, not run to fail.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import RunConfig, config_from_dict, read_yaml
from ..dotted import set_dotted
from ..errors import UserError
from ..specs.registry import DEFAULT_STRATEGY, spec
from ..layout import data_parallel_size
from .machine import MACHINE, device_of, machine_gpu_counts

EQUAL_KEYS = ("precision", "global_batch", "micro_batch", "seq_len", "tokens", "steps")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExtraCell(_Strict):
    label: str | None = None
    set: dict[str, Any]
    differs: list[str] = Field(default_factory=list, description="equal keys this cell deliberately differs in")


class Part(_Strict):
    name: str
    base: dict[str, Any] = Field(default_factory=dict, description="RunConfig keys for this part's cells only")
    compare: str = "strategy"
    equal: list[str] = Field(default_factory=lambda: ["precision", "global_batch", "seq_len", "tokens"])
    axes: dict[str, list[Any] | Literal["machine"]] = Field(
        default_factory=dict, description="key -> values; `gpus: machine` = this machine's GPU counts (bench/machine.py)")
    cells: list[ExtraCell] = Field(default_factory=list)

    @field_validator("axes")
    @classmethod
    def _machine_only_for_gpus(cls, axes: dict[str, Any]) -> dict[str, Any]:
        for key, values in axes.items():
            if values == MACHINE and key != "gpus":
                raise ValueError(f"axis {key!r}: {MACHINE!r} is a value of the gpus axis only")
        return axes


class Suite(_Strict):
    name: str = ""
    description: str = ""
    repeats: int = Field(1, gt=0)
    interleave: bool = Field(False, description="run repeats round-robin over the cells, so drift of the host hits all alike")
    base: dict[str, Any] = Field(default_factory=dict)
    parts: list[Part]


@dataclass
class Cell:
    """One configuration of the matrix; run `repeats` times, each in a fresh process."""

    label: str
    config: dict[str, Any]  # nested RunConfig data without output_dir
    parts: list[str] = field(default_factory=list)  # "suite/part" names this cell belongs to
    differs: list[str] = field(default_factory=list)
    repeats: int = 1
    axis_keys: set[str] = field(default_factory=set)  # keys the matrix's axes set on this cell
    suite: str = ""  # the first suite that asked for this cell (labels are made per suite)
    timeout: float | None = None  # seconds for each repeat; None: the bench's --cell-timeout (a cells file sets its own)
    env: dict[str, str] = field(default_factory=dict)  # added to each repeat's environment (a cells file's VAR=value)

    def run_config(self, output_dir: str | Path) -> RunConfig:
        return config_from_dict({**copy.deepcopy(self.config), "output_dir": str(output_dir)})


# --------------------------------------------------------------------------------------------------
# Loading


def builtin_suites() -> dict[str, Path]:
    folder = resources.files("shardlab.bench") / "suites"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def load_suite(name_or_path: str) -> Suite:
    """A built-in suite by name (`strategies`, `quick`, ...) or a suite YAML file."""
    known = builtin_suites()
    if name_or_path in known:
        path = known[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(f"unknown bench suite {name_or_path!r}", f"use one of {', '.join(sorted(known))} or a suite YAML file")
    data = read_yaml(path)
    data.setdefault("name", path.stem)
    try:
        return Suite.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(f"suite {str(path)!r}: {where}: {first['msg']}", "fix the suite YAML (see shardlab/bench/suites/*.yaml)") from None


# --------------------------------------------------------------------------------------------------
# Expansion


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        set_dotted(out, k, copy.deepcopy(v), hint="check the key path in the suite")
    return out


@dataclass
class Overrides:
    """What the command line changes in every suite."""

    axes: dict[str, list[Any]] = field(default_factory=dict)  # replaces these axes in every part
    base: dict[str, Any] = field(default_factory=dict)  # dotted RunConfig keys set in every cell's base
    repeats: int | None = None


def resolved_batch(config: dict[str, Any]) -> tuple[int, int, int]:
    """(micro, accum, global) as the run will resolve them on gpus x nodes ranks (layout.py: a pipeline's stages share one batch)."""
    cfg = config_from_dict(config)
    world = (cfg.gpus or 1) * cfg.nodes
    if spec(cfg.strategy).engine == "pipelining":
        cfg = cfg.with_pipeline_microbatches(world)[0]  # what the run will use without --microbatches
    return cfg.resolve_batch(data_parallel_size(cfg, world))


def footing(config: dict[str, Any]) -> dict[str, Any]:
    """The quantities that must agree for a fair comparison (precision, batch, sequence, tokens)."""
    micro, _, glob = resolved_batch(config)
    steps = config.get("max_steps")
    seq = config.get("seq_len", RunConfig.model_fields["seq_len"].default)
    return {
        "precision": config.get("precision", "auto"),
        "global_batch": glob,
        "micro_batch": micro,
        "seq_len": seq,
        "steps": steps if steps else f"epochs={config.get('epochs', 1)}",
        "tokens": steps * glob * seq if steps else f"epochs={config.get('epochs', 1)} x global {glob} x seq {seq}",
    }


def _identity(config: dict[str, Any]) -> str:
    """Cells that resolve to the same run are one cell (e.g. a 2-GPU run shared by weak and strong scaling)."""
    micro, accum, glob = resolved_batch(config)
    c = copy.deepcopy(config)
    c.update(micro_batch=micro, grad_accum=accum, global_batch=glob)
    return yaml.safe_dump(config_from_dict(c).model_dump(mode="json"), sort_keys=True)


def unsupported(config: dict[str, Any]) -> str | None:
    """Why the strategy's spec says it cannot run ``config``, or None; and the compiled ZeRO-3 runs the strategy refuses
    on this machine's device (strategies/deepspeed_config.compile_problem)."""
    s = spec(config.get("strategy", DEFAULT_STRATEGY))
    if config.get("compile") and not s.supports_compile:
        return f"{s.name} does not support compile"
    if config.get("compile") and s.engine == "deepspeed" and s.zero_stage == 3:
        from ..strategies.deepspeed_config import compile_problem

        try:
            problem = compile_problem(config_from_dict(config), device_of(config))
        except UserError:  # a bad config or an unknown model: the cell's own validation says so
            return None
        return problem.message if problem else None
    return None


def expand(suites: list[Suite], overrides: Overrides | None = None, left_out: list[str] | None = None) -> list[Cell]:
    """All cells of the suites, deduplicated, labelled, validated and checked for equal footing. Axis combinations
    the strategy cannot run are left out, and said why in ``left_out`` when given."""
    ov = overrides or Overrides()
    cells: dict[str, Cell] = {}
    explicit: dict[str, str] = {}
    for suite in suites:
        base = _merge(suite.base, ov.base)
        repeats = ov.repeats or suite.repeats
        for part in suite.parts:
            part_cells: list[tuple[Cell, dict[str, Any]]] = []
            axes = dict(part.axes)
            for key, values in ov.axes.items():
                axes[key] = list(values)
            if axes.get("gpus") == MACHINE:
                axes["gpus"] = machine_gpu_counts(device_of(_merge(base, part.base)))
            keep_strategies = ov.axes.get("strategy")
            specs: list[tuple[str | None, dict[str, Any], list[str]]] = [(None, {}, [])]
            specs += [(c.label, c.set, c.differs) for c in part.cells
                      if keep_strategies is None or "strategy" not in c.set or c.set["strategy"] in keep_strategies]
            for i, (label, sets, differs) in enumerate(specs):
                if i == 0 and not axes:
                    continue
                free = {k: v for k, v in axes.items() if k not in sets}
                keys = list(free)
                for combo in itertools.product(*(free[k] for k in keys)) if keys else [()]:
                    point = dict(zip(keys, combo))
                    config = _merge(_merge(base, part.base), {**point, **sets})
                    config.pop("output_dir", None)
                    where = f"suite {suite.name!r} part {part.name!r}"
                    why = unsupported(config) if set(point) & {"compile", "strategy"} else None
                    if why is not None:  # an axis combination, not a cell's point: left out
                        if left_out is not None:
                            left_out.append(f"{where}: {', '.join(f'{k}={v}' for k, v in point.items())} ({why})")
                        continue
                    try:
                        config_from_dict(config)
                    except UserError as err:
                        raise UserError(f"{where}: {err.message}", err.hint) from None
                    ident = _identity(config)
                    cell = cells.get(ident)
                    if cell is None:
                        cell = cells[ident] = Cell(label="", config=config, differs=list(differs), repeats=repeats, suite=suite.name)
                    cell.axis_keys |= set(keys)
                    cell.repeats = max(cell.repeats, repeats)
                    cell.parts.append(f"{suite.name}/{part.name}")
                    if label:
                        explicit[ident] = label
                    part_cells.append((cell, {**point, **sets}))
            _check_footing(suite.name, part, set(axes), part_cells)
    return _label_by_suite(cells, explicit)


def _label_by_suite(cells: dict[str, Cell], explicit: dict[str, str]) -> list[Cell]:
    """The cells (identity -> cell), labelled by what varies within their suite; a label two suites share gets the
    suite's name appended."""
    out = list(cells.values())
    idents = list(cells)
    used: set[str] = set()
    for suite in dict.fromkeys(c.suite for c in out):
        mine = [(c, i) for c, i in zip(out, idents) if c.suite == suite]
        _label([c for c, _ in mine], explicit, [i for _, i in mine])
        for c, _ in mine:
            if c.label in used:
                c.label = f"{c.label}-{suite}"
            used.add(c.label)
    return out


def _check_footing(suite: str, part: Part, axes: set[str], part_cells: list[tuple[Cell, dict[str, Any]]]) -> None:
    """Cells compared in one table (same values on every axis but the compared one) must agree on the part's equal keys."""
    groups: dict[str, list[tuple[Cell, dict[str, Any]]]] = {}
    for cell, point in part_cells:
        key = yaml.safe_dump({k: v for k, v in point.items() if k in axes and k != part.compare}, sort_keys=True)
        groups.setdefault(key, []).append((cell, point))
    for members in groups.values():
        ref_cell = next((c for c, _ in members if not c.differs), members[0][0])
        ref = footing(ref_cell.config)
        for cell, _ in members:
            got = footing(cell.config)
            for key in part.equal:
                if key not in EQUAL_KEYS:
                    raise UserError(f"suite {suite!r} part {part.name!r}: unknown equal key {key!r}", f"use some of {', '.join(EQUAL_KEYS)}")
                if got[key] != ref[key] and key not in cell.differs and key not in ref_cell.differs:
                    raise UserError(
                        f"suite {suite!r} part {part.name!r}: cells would differ in {key} ({ref[key]} vs {got[key]}), "
                        f"so the comparison would not be on equal footing",
                        f"set {key} in the suite's base (or on the command line for every cell), or list {key!r} in the cell's `differs`",
                    )


# --------------------------------------------------------------------------------------------------
# Labels


_SHORT = {"gpus": "g", "micro_batch": "mb", "grad_accum": "ga", "global_batch": "gb", "seq_len": "seq", "max_steps": "steps"}


def _label_part(key: str, value: Any) -> str:
    if key in ("model", "strategy", "precision"):
        return str(value)
    name = key.split(".")[-1]
    if isinstance(value, bool):
        return {"pin_memory": "pinned" if value else "unpinned", "compile": "compiled" if value else "eager",
                "gradient_checkpointing": "ckpt" if value else "nockpt"}.get(name, f"{name}={str(value).lower()}")
    return f"{_SHORT.get(name, name)}{value}" if name in _SHORT else f"{name}={value}"


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _label(cells: list[Cell], explicit: dict[str, str], idents: list[str]) -> None:
    """Name each cell by its strategy and what sets it apart: values of keys that vary across the bench,
    leaving out a value most cells share (the suite's base). Explicit labels win."""
    flats = []
    for c in cells:
        f = _flat(c.config)
        f["micro_batch"] = resolved_batch(c.config)[0]
        f.pop("global_batch", None)  # derived from micro x accum x GPUs; its parts name it
        f.pop("grad_accum", None)
        flats.append(f)
    keys = sorted({k for f in flats for k in f})
    varying = [k for k in keys if len({repr(f.get(k)) for f in flats}) > 1]
    order = ["model", "strategy", "precision"]
    varying.sort(key=lambda k: (order.index(k) if k in order else len(order), k))
    common = {}
    for k in varying:
        value, count = Counter(repr(f.get(k)) for f in flats).most_common(1)[0]
        if count * 2 > len(flats) and k not in ("model", "strategy"):
            common[k] = value
    taken: set[str] = set()
    for cell, f, ident in zip(cells, flats, idents):
        named = explicit.get(ident)
        if named:  # its label names what the cell sets; add only what the axes vary on it
            parts = [str(f.get("model"))] if "model" in varying and "model" in cell.axis_keys else []
            parts.append(named)
            parts += [_label_part(k, f.get(k)) for k in varying
                      if k in cell.axis_keys and k not in ("model", "strategy") and f.get(k) is not None and common.get(k) != repr(f.get(k))]
        else:
            parts = [str(f.get("model"))] if "model" in varying else []
            parts.append(str(f.get("strategy", DEFAULT_STRATEGY)))
            parts += [_label_part(k, f.get(k)) for k in varying
                      if k not in ("model", "strategy") and f.get(k) is not None and common.get(k) != repr(f.get(k))]
        label = "-".join(parts)
        label = re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
        base, n = label, 2
        while label in taken:
            label, n = f"{base}-{n}", n + 1
        taken.add(label)
        cell.label = label


__all__ = ["Suite", "Part", "ExtraCell", "Cell", "Overrides", "builtin_suites", "load_suite", "expand", "footing", "unsupported", "EQUAL_KEYS"]
