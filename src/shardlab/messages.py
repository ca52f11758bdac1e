"""shardlab's progress lines: one logger ("shardlab"), each line "[shardlab] ..." on stdout, from rank 0 only.

``--log-level`` (debug, info, warning, error; default info) and ``--quiet`` (warning) set the level of the command and
of every worker it starts (they read SHARDLAB_LOG_LEVEL). Errors keep their own path (errors.say: one line on stderr).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

LOGGER = logging.getLogger("shardlab")
LEVEL_ENV = "SHARDLAB_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")


def rank_zero() -> bool:
    """This process is rank 0 of a launched job (shardlab's workers, torchrun, srun), or the launching process."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


class _RankZero(logging.Filter):
    """Rank 0's lines only: every rank runs the same step and would say the same thing; warnings from every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or rank_zero()


class _Stdout(logging.StreamHandler):
    """Writes to the sys.stdout of the moment (a test's capture, a redirected notebook cell), not the one at import."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("[shardlab] %(message)s"))
        self.addFilter(_RankZero())

    @property
    def stream(self):  # noqa: D102
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure(level: str | None = None) -> None:
    """Set the level (``level``, else SHARDLAB_LOG_LEVEL, else info) for this process and the workers it starts."""
    name = (level or os.environ.get(LEVEL_ENV) or "info").lower()
    if name not in LEVELS:
        name = "info"
    os.environ[LEVEL_ENV] = name
    LOGGER.setLevel(name.upper())


@contextlib.contextmanager
def at_level(level: str | None) -> Iterator[None]:
    """``configure(level)`` for one command, its environment variable and the logger's level given back after (a
    notebook or test calling the CLI in process keeps its own)."""
    _ready()
    before_env, before = os.environ.get(LEVEL_ENV), LOGGER.level
    configure(level)
    try:
        yield
    finally:
        if before_env is None:
            os.environ.pop(LEVEL_ENV, None)
        else:
            os.environ[LEVEL_ENV] = before_env
        LOGGER.setLevel(before)


def _ready() -> None:
    if not any(isinstance(h, _Stdout) for h in LOGGER.handlers):
        LOGGER.addHandler(_Stdout())
        LOGGER.propagate = False
        configure(None)


def shows(level: str) -> bool:
    """Whether lines of ``level`` are shown (what else a command prints, e.g. its summary table, follows the same level)."""
    _ready()
    return LOGGER.isEnabledFor(getattr(logging, level.upper()))


def info(msg: str) -> None:
    _ready()
    LOGGER.info(msg)


def debug(msg: str) -> None:
    _ready()
    LOGGER.debug(msg)


def warning(msg: str) -> None:
    _ready()
    LOGGER.warning(msg)


__all__ = ["info", "debug", "warning", "shows", "configure", "at_level", "rank_zero", "LEVELS", "LEVEL_ENV"]
