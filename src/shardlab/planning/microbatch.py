"""The micro batches `--micro-batch auto` may choose, and the one "largest that fits" search.

Shared by the plan (micro_search.py: auto's start, each strategy's largest micro batch), run_plan.py (the advice) and
autobatch.py (the trial runs): they sit below all three, so none of them imports another for these. No torch.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import RunConfig
from ..errors import UserError

CPU_MAX_MICRO = 64  # on a CPU a larger micro batch only makes each step longer once the cores are busy
MAX_MICRO = 4096


# ---- the batch triple ----------------------------------------------------------------------------------


def check_auto_batch(cfg: RunConfig, dp_world: int) -> None:
    """The batch triple around `auto`: something must be left for the micro batch to choose."""
    if cfg.grad_accum is not None and cfg.global_batch is not None:
        raise UserError(
            f"--micro-batch auto with both --grad-accum {cfg.grad_accum} and --global-batch {cfg.global_batch}: "
            "they already fix the micro batch",
            "give only --global-batch (auto then keeps it by changing the accumulation) or only --grad-accum",
        )
    if cfg.global_batch is not None and cfg.global_batch % dp_world:
        raise UserError(
            f"global_batch {cfg.global_batch} is not divisible by the data-parallel world size {dp_world}",
            f"use a global batch that is a multiple of {dp_world}, or change --gpus",
        )


def micro_candidates(cfg: RunConfig, dp_world: int, upper: int = MAX_MICRO) -> list[int]:
    """Allowed micro batches, ascending, up to ``upper``: divisors of the per-rank batch when a global batch is given."""
    if cfg.global_batch is not None:
        per_rank = cfg.global_batch // dp_world
        return [m for m in range(1, min(per_rank, upper) + 1) if per_rank % m == 0]
    return list(range(1, max(1, upper) + 1))


def with_micro_batch(cfg: RunConfig, micro: int) -> RunConfig:
    """``cfg`` with the micro batch fixed; a given global batch is kept (accumulation follows), else grad_accum is."""
    return cfg.model_copy(update={"micro_batch": micro})



# ---- the search -------------------------------------------------------------------------------------------


def largest_that_fits(n: int, fits: Callable[[int], bool], start: int = 0) -> int:
    """The largest index below ``n`` for which ``fits`` holds, or -1: the one "largest micro batch that
    fits" search, over indices into a caller's ascending candidates. ``fits`` is asked at most once per
    index; it may raise (the trials' search stops that way).

    From ``start``, up while it fits (doubling the step, the largest index included), or down while it
    does not (doubling), then bisection between the largest that fitted and the smallest that did not.
    Used for the plan's predictions (micro_search: ``auto``'s start, each strategy's max micro batch;
    run_plan: the advice) and for the trial runs (``search_micro_batch``). For a ``fits`` that holds up to
    some index and not above it (as memory does) the answer is that index, whatever ``start``; the plan's
    two former searches galloped from 1 too but did not try the largest candidate when a doubling passed
    it (`largest_micro` even stopped at a power of two below a ``max_search`` that was not one), the
    advice's scanned down one by one: the same answers, with fewer predictions.
    """
    known: dict[int, bool] = {}

    def ok(i: int) -> bool:
        if i not in known:
            known[i] = fits(i)
        return known[i]

    if n <= 0:
        return -1
    i, step = min(max(start, 0), n - 1), 1
    if ok(i):
        lo, hi = i, n  # largest index that fitted, smallest index known not to (n: none)
        while hi == n:
            nxt = min(lo + step, n - 1)
            if nxt == lo:
                break
            if ok(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        hi = i
        while True:
            if hi == 0:
                return -1
            nxt = max(hi - step, 0)
            if ok(nxt):
                lo = nxt
                break
            hi, step = nxt, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
