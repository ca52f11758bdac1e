"""Timing each pipeline stage's forward and backward by wrapping the methods torch's schedules call.

torch.distributed.pipelining's schedules run a stage's micro-batch through ``forward_one_chunk``,
``backward_one_chunk`` and, under zero-bubble schedules, ``backward_weight_one_chunk``: methods of the stage that the
schedule's private step loop calls, with no hook of their own. The pipeline strategy measures each one (its
StageTimer: the per-stage times summary.json's ``pipeline`` record and ``shardlab pipeline simulate`` use) by
wrapping them on each stage object. Outside the torch versions this was tested on, the stages run unwrapped and the
record says that no per-stage time was measured.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from . import applied, enabled

# the stage's methods the schedules call, and the kind of work each is (StageTimer's keys)
METHODS = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


def time_stages(stages: Iterable[tuple[int, Any]], wrap: Callable[[Callable, int, str], Callable]) -> bool:
    """Replace each (index, stage)'s METHODS with ``wrap(method, index, kind)`` on that stage object; whether it did."""
    if not enabled("stage_timer"):
        return False
    for s, stage in stages:
        for name, kind in METHODS:
            setattr(stage, name, wrap(getattr(stage, name), s, kind))
    applied("stage_timer")
    return True
