"""Terminal timeline: one row per device, one fixed-width cell per time quantum.

A cell shows the action occupying the middle of that quantum (`F3` = forward of micro-batch 3,
`B3` = its backward, `I3`/`W3` = its input / weight gradient under a split backward (zbv), lower
case `f3`/`b3` = an odd chunk) or `.` when idle.
"""

from __future__ import annotations

from fractions import Fraction
from math import gcd
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .simulator import Timeline


def _quantum(times: list[float]) -> Fraction:
    """Largest step that all event boundaries are multiples of (so each cell is one kind of action)."""
    fracs = [Fraction(t).limit_denominator(240) for t in times if t > 0]
    if not fracs:
        return Fraction(1)
    den = 1
    for f in fracs:
        den = den * f.denominator // gcd(den, f.denominator)
    num = 0
    for f in fracs:
        num = gcd(num, int(f * den))
    return Fraction(num or 1, den)


def ascii_timeline(tl: "Timeline", width: int = 120, max_cells: int = 600) -> str:
    """Rows of at most `width` characters; longer timelines wrap into blocks of time."""
    q = _quantum([t for e in tl.events for t in (e.start, e.end)])
    makespan = Fraction(tl.makespan).limit_denominator(240)
    n = int(makespan / q + Fraction(1, 2))
    note = ""
    if n > max_cells:  # very long runs: coarser cells, sampled at their middle
        q = makespan / max_cells
        n = max_cells
        note = " (sampled: a cell may hide a short action)"
    naive = tl.schedule == "naive"
    cell_w = 2 if naive else 1 + max(len(str(e.microbatch)) for e in tl.events)
    grid = []
    for d in range(tl.stages):
        evs = tl.device_events(d)
        cells, i = [], 0
        for c in range(n):
            mid = float((c + Fraction(1, 2)) * q)
            while i < len(evs) and evs[i].end <= mid:
                i += 1
            e = evs[i] if i < len(evs) and evs[i].start <= mid else None
            if e is None:
                cells.append(".".ljust(cell_w))
                continue
            kind = e.kind if e.chunk % 2 == 0 else e.kind.lower()
            cells.append((kind + ("*" if naive else str(e.microbatch))).ljust(cell_w))
        grid.append(cells)
    name_w = len(str(tl.stages - 1))
    per_block = max(1, (width - name_w - 16) // cell_w)
    blocks = []
    for lo in range(0, n, per_block):
        hi = min(n, lo + per_block)
        rows = [f"t={float(lo * q):g}..{float(hi * q):g}"] if n > per_block else []
        for d in range(tl.stages):
            tail = f" {tl.metrics['utilisation'][d]:5.1%} busy" if hi == n else ""
            rows.append(f"dev{d:<{name_w}} |{''.join(grid[d][lo:hi])}|{tail}")
        blocks.append("\n".join(rows))
    legend = f"1 cell = {float(q):g} time units{note}; F/B = forward/backward of micro-batch n, . = idle"
    if naive:
        legend += ", * = the whole batch"
    if any(e.kind == "W" for e in tl.events):
        legend += "; I/W = input/weight gradient (the backward split; the first stage's I is empty)"
    if tl.chunks > 1:
        legend += "; lower case = odd chunk"
    return "\n\n".join(blocks) + "\n" + legend
