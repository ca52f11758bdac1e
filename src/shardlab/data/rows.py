"""What a source yields: rows (a ``list[dict]`` or a ``datasets.Dataset``) split into train and eval.

Its own module, below sources.py and hub.py, so that hub.py (loaded only for hub datasets) and sources.py
(which calls it) do not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Rows = Any  # list[dict] | datasets.Dataset


@dataclass
class RawSplits:
    train: Rows
    eval: Rows | None  # None: the source has no eval split, so one is held out
    description: str
