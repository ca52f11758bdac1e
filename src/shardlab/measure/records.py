"""Run-directory records written whole or not at all, and read back whatever a kill left.

A job can be killed at any instruction (SIGKILL, the OOM killer, a preempted node). A file rewritten in place is
then empty or half old, half new; a file appended to ends in a torn line. So a rewrite goes to a temporary file in the
same directory, flushed to disk, then renamed over the old one (``os.replace`` is atomic on POSIX: a reader sees the
old file or the new one); and a reader of a JSON-lines file skips a line that does not parse (only the last line can
be torn, as every writer appends whole lines). Importable without torch: the supervising process reads the plan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a directory fsync; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``path`` holds ``text`` or its old content, never a part of either; a killed writer leaves only a hidden
    ``.NAME.PID.tmp`` beside it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def read_json(path: str | Path) -> Any | None:
    """The JSON value in ``path``; None when there is none or it is not whole (its writer was killed)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one per line; a line that does not parse (torn by a kill) is skipped.
    [] when there is no file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows
