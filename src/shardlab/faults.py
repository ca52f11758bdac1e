"""Deliberate failures, for the tests of crash safety and of the guards. Never set in normal use.

SHARDLAB_FAULTS is a comma-separated list of
    kill_in_save@STEP[:RANK]   the rank SIGKILLs itself while the checkpoint of STEP is half-written
                               (its shards are on disk, the directory is not yet renamed)
    nan_loss@STEP[:RANK]       the rank's batches of STEP carry no label (HF's loss is then 0/0 = NaN)
RANK defaults to every rank. Nothing here runs unless the variable is set.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

ENV = "SHARDLAB_FAULTS"


def _wanted(kind: str, step: int, rank: int) -> bool:
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        name, _, where = item.strip().partition("@")
        at, _, only_rank = where.partition(":")
        if name == kind and int(at) == step and (not only_rank or int(only_rank) == rank):
            return True
    return False


def in_save(step: int, rank: int) -> None:
    if ENV in os.environ and _wanted("kill_in_save", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def poison_batches(batches: Iterator[dict[str, Any]], first_step: int, accum: int, rank: int) -> Iterator[dict[str, Any]]:
    """Wrap the micro-batch iterator of an epoch whose next optimizer step is `first_step + 1`."""
    if ENV not in os.environ:
        return batches

    def gen():
        for i, batch in enumerate(batches):
            step = first_step + 1 + i // accum
            if _wanted("nan_loss", step, rank):
                batch = dict(batch, labels=batch["labels"].clone().fill_(-100))
            yield batch

    return gen()
