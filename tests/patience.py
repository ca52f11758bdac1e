"""How long a test waits for work before it calls the work hung.

A limit on a wait for work (a training run, a bench, a daemon coming up) is a guard against a hang, measured on an idle
machine; on a shared one the same work takes as many times longer as there are runnable processes per core. So a guard
is stretched by the load when the wait starts (the 1-minute load average over the cores this process may use), never
shortened. A wait for a peer's answer is no guard at all: it waits on the peer's readiness (zygote.py).
"""

from __future__ import annotations

import os


def load_factor() -> float:
    """Runnable processes per usable core over the last minute, at least 1."""
    return max(1.0, os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0))))


def patience(seconds: float | None) -> float | None:
    """The guard `seconds` (None: no limit) stretched by the machine's load."""
    return None if seconds is None else seconds * load_factor()
