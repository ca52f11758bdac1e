"""Deliberate failures, for the tests of crash safety and of the guards. Never set in normal use.

SHARDLAB_FAULTS is a comma-separated list of
    kill_in_save@STEP[:RANK]   the rank SIGKILLs itself while the checkpoint of STEP is half-written
                               (its shards are on disk, the directory is not yet renamed)
    nan_loss@STEP[:RANK]       the rank's LM head returns NaN logits in STEP (loss and gradients NaN)
    kill@STEP[:RANK]           the rank SIGKILLs itself in its first training forward of STEP (mid-step, as the
                               kernel's OOM killer would): the crash tests' first kill, at a known step, with no
                               polling from outside
    raise@STEP[:RANK]          the rank raises a RuntimeError there instead: a bug, whose traceback must reach the user
RANK defaults to every rank. Nothing here runs unless the variable is set.
"""

from __future__ import annotations

import os
import signal

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


def arm(model, rank: int, done_steps: int, accum: int) -> None:
    """nan_loss: NaN logits from the LM head in the training forwards of the chosen step, so that the
    loss *and* every gradient are NaN, as after a real overflow; kill: SIGKILL in that step's first
    training forward. Eval forwards are left alone."""
    if ENV not in os.environ or not any(kind in os.environ[ENV] for kind in ("nan_loss", "kill@", "raise@")):
        return
    head = model.get_output_embeddings()
    calls = {"n": 0}

    def hook(module, args, output):
        if not module.training:
            return output
        step = done_steps + 1 + calls["n"] // accum
        calls["n"] += 1
        if _wanted("kill", step, rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if _wanted("raise", step, rank):
            raise RuntimeError(f"deliberate fault in step {step} on rank {rank} ({ENV})")
        return output * float("nan") if _wanted("nan_loss", step, rank) else output

    head.register_forward_hook(hook)
