"""Train/eval selection: the source's own eval split, else a seeded held-out fraction of the deduplicated rows.

The caps (num_samples, eval_samples) apply later, to usable examples, so that blank
rows (wikitext has many) do not count against them.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import unicodedata
from dataclasses import dataclass
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


@dataclass
class Dropped:
    """Duplicate rows dropped before a held-out split: identical ones, and near ones (the same text once case,
    punctuation and whitespace are normalised)."""

    exact: int = 0
    near: int = 0

    @property
    def total(self) -> int:
        return self.exact + self.near


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k in sorted(value) for s in _strings(value[k])]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [] if value is None else [str(value)]


def normalised(row: dict) -> str:
    """A row's text (every field, in key order) with case, punctuation and runs of whitespace made alike."""
    text = unicodedata.normalize("NFKC", " ".join(_strings(row))).casefold()
    return " ".join(re.sub(r"[\W_]+", " ", text).split())


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def deduplicated(rows: Any) -> tuple[list[int], Dropped]:
    """Indices of the rows to keep (each row's first copy; rows with no text at all are kept: formats skip them) and
    what was dropped. A held-out split of rows with copies puts copies of training rows in eval: the offline corpus
    repeats whole pydoc sections (62 of its 552 records), and 8 of 28 held-out records were training records."""
    keep, dropped = [], Dropped()
    exact_seen, near_seen = set(), set()
    for i, row in enumerate(rows):
        near = normalised(row)
        if not near:
            keep.append(i)
            continue
        exact = _digest(json.dumps(row, sort_keys=True, default=str))
        if exact in exact_seen:
            dropped.exact += 1
        elif _digest(near) in near_seen:
            dropped.near += 1
        else:
            keep.append(i)
            exact_seen.add(exact)
            near_seen.add(_digest(near))
    return keep, dropped


def select_splits(raw: RawSplits, ds: DatasetConfig, seed: int) -> tuple[Any, Any | None, Dropped]:
    """(train rows, eval rows or None, duplicates dropped). A source's own eval split is taken as it is; a held-out
    one is drawn after duplicates are dropped, so that no eval row is a copy of a training row."""
    train, evals = raw.train, raw.eval
    dropped = Dropped()
    if evals is not None and rows_len(evals) == 0:
        evals = None
    if evals is None and ds.eval_split > 0:
        keep, dropped = deduplicated(train)
        if dropped.total:
            train = rows_select(train, keep)
        train_idx, eval_idx = held_out_indices(rows_len(train), ds.eval_split, seed)
        evals = rows_select(train, eval_idx) if eval_idx else None
        if eval_idx:
            train = rows_select(train, train_idx)
    return train, evals, dropped
