"""Train/eval selection: the source's own eval split, else a seeded held-out fraction.

The caps (num_samples, eval_samples) apply later, to usable examples, so that blank
rows (wikitext has many) do not count against them.
"""

from __future__ import annotations

import random
from typing import Any

from ..config import DatasetConfig
from .rows import RawSplits
from .sources import rows_len, rows_select


def held_out_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices, each in original order; eval gets at least one item when fraction > 0.

    A single item stays in training: an empty training set is worse than no eval.
    """
    if fraction <= 0 or n < 2:
        return list(range(n)), []
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_eval = min(n - 1, max(1, round(n * fraction)))
    # Sorted so that "the first N training examples" means the source's order, not the shuffle's.
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def select_splits(raw: RawSplits, ds: DatasetConfig, seed: int) -> tuple[Any, Any | None]:
    """(train rows, eval rows or None)."""
    train, evals = raw.train, raw.eval
    if evals is not None and rows_len(evals) == 0:
        evals = None
    if evals is None:
        train_idx, eval_idx = held_out_indices(rows_len(train), ds.eval_split, seed)
        evals = rows_select(train, eval_idx) if eval_idx else None
        if eval_idx:
            train = rows_select(train, train_idx)
    return train, evals
