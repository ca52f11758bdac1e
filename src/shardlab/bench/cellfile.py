"""A cells file: a list of `shardlab train` command lines the bench runs as they stand, one cell each.

    # comments and blank lines are skipped
    <label> <timeout_s> [VAR=value ...] <shardlab train flags ...>
    zero3-m8   300  --model llama-2-7b --strategy zero3 --micro-batch 8 --max-steps 20
    fsdp-nocud 300  SHARDLAB_DIAG_NO_CUDNN_SDP=1 --model llama-2-7b --strategy fsdp --micro-batch 8

For the runs a suite's matrix does not describe (a diagnosis, a probe, a before/after pair): the same runner as
every bench (a fresh process per repeat, its own timeout, failures recorded with their reason, finished runs kept,
`--budget-s`, interleaved repeats) and the same report. Leading VAR=value words are set in that run's environment.
The flags are read by `shardlab train`'s own parser (passed in by the command line: the bench sits below it), so a
mistyped flag is refused before anything runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from .matrix import Cell

_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def read_cells_file(path: str | Path, to_config: Callable[[list[str]], dict[str, Any]], common: list[str] | None = None,
                    repeats: int = 1) -> list[Cell]:
    """The cells of ``path``; ``to_config`` turns `shardlab train` flags into the given RunConfig keys (nested, no
    output_dir); ``common`` flags are added to every line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"cannot read the cells file {path}: {err.strerror or err}", "pass an existing file to --cells") from None
    cells: list[Cell] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        where = f"{path}:{number}"
        if len(words) < 2 or not _LABEL.match(words[0]):
            raise UserError(f"{where}: a cell line starts with a label and a timeout in seconds",
                            "write e.g. `zero3-m8 300 --strategy zero3 --micro-batch 8`")
        label, limit, rest = words[0], words[1], words[2:]
        try:
            timeout = float(limit)
        except ValueError:
            raise UserError(f"{where}: timeout {limit!r} is not a number of seconds", "write e.g. `zero3-m8 300 --strategy zero3`") from None
        env = {}
        while rest and _ENV.match(rest[0]):
            key, _, value = rest.pop(0).partition("=")
            env[key] = value
        if any(c.label == label for c in cells):
            raise UserError(f"{where}: label {label!r} is used twice", "give each line its own label")
        try:
            config = to_config([*rest, *(common or [])])
        except UserError as err:
            raise UserError(f"{where}: {err.message}", err.hint) from None
        config.pop("output_dir", None)  # each repeat gets its own run directory
        cells.append(Cell(label=label, config=config, parts=[], repeats=repeats, suite=path.stem, timeout=timeout, env=env))
    if not cells:
        raise UserError(f"the cells file {path} has no cell lines", "write one `<label> <timeout_s> <train flags>` per line")
    return cells


__all__ = ["read_cells_file"]
