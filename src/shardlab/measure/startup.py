"""Where the time to the first optimizer step goes: named moments of the worker, each
phase the wall time since the previous moment, the first since the command started (``process_start_time``: the
launcher's start, so spawning the worker and its imports are the first phase).

Phases, in order: ``launch_and_imports`` (interpreter, imports, the launcher's checks, spawning this worker, joining the process group),
``data`` (tokenising or reading the cache), ``model_build`` (the weights the engine keeps), ``engine_setup``
(wrapping, optimizer; DeepSpeed builds its ops here), ``optimizer_compile`` (8-bit AdamW only: torchao's step
compiled and autotuned before training, loop/warm_8bit.py), ``initial_eval`` (the baseline eval, when on) and ``first_step``
(the first optimizer step, with any compile it triggers: ``compile_time_s`` says how much)."""

from __future__ import annotations

import time

from .compile_stats import process_start_time

PHASES = ("launch_and_imports", "data", "model_build", "engine_setup", "optimizer_compile", "initial_eval", "first_step")


class StartupClock:
    def __init__(self) -> None:
        self.moments: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """``phase`` ended now (a phase marked twice keeps its first end: resumed loops do not move it)."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}")
        self.moments.setdefault(phase, time.time())

    def phases(self) -> dict[str, float]:
        """Seconds per phase marked so far, in PHASES order; their sum is the time to the last moment."""
        out: dict[str, float] = {}
        before = process_start_time()
        for phase in PHASES:
            if phase in self.moments:
                out[phase] = round(self.moments[phase] - before, 3)
                before = self.moments[phase]
        return out

    def line(self) -> str:
        parts = self.phases()
        return f"start-up {sum(parts.values()):.1f} s: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts.items())
