"""The eval-loss bookkeeping of a run: the loss before training, the best so far, early stopping.

The trainer feeds it every evaluation made after a training step; the initial evaluation (before
the first step) is the baseline, recorded but not a candidate for "best": the best step is a step
that was trained. Its state travels in every checkpoint's trainer_state.json, so a resumed run
keeps counting where the preempted one stopped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EvalTracker:
    patience: int | None = None  # evaluations in a row without a new best before stopping; None: never stop
    initial: float | None = None  # eval loss before the first step
    best: float | None = None
    best_step: int | None = None
    since_best: int = 0  # evaluations since the best one
    stopped_early: bool = False

    def update(self, step: int, loss: float) -> bool:
        """Record the eval loss after `step`; True when it is a new best (strictly lower; NaN never is)."""
        if math.isfinite(loss) and (self.best is None or loss < self.best):
            self.best, self.best_step, self.since_best = loss, step, 0
            return True
        self.since_best += 1
        if self.patience is not None and self.since_best >= self.patience:
            self.stopped_early = True
        return False

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "patience"}

    @classmethod
    def restore(cls, patience: int | None, state: dict[str, Any] | None) -> "EvalTracker":
        """A tracker with this run's patience and a checkpoint's counts (fresh when it has none)."""
        return cls(patience=patience, **(state or {}))

    def summary(self) -> dict[str, Any]:
        """summary.json's fields."""
        return {"initial_eval_loss": self.initial, "best_eval_loss": self.best, "best_step": self.best_step,
                "stopped_early": self.stopped_early, "early_stopping_patience": self.patience}
