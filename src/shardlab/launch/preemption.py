"""Signals that end or checkpoint a run gracefully: SLURM's preemption warning and on-demand saves.

SLURM sends SIGTERM before it kills a job (preemption, `scancel`, `scontrol requeue`) and, with
`sbatch --signal=USR1@SECONDS`, SIGUSR1 that long before the time limit. Both mean: every rank
finishes its current optimizer step, a checkpoint is written, and the process exits with
REQUEUE_EXIT, which the script `shardlab slurm` writes turns into `scontrol requeue`; the requeued
job resumes with `--resume auto`. SIGUSR2 asks for a checkpoint without stopping.

A signal may reach one rank or all of them (SLURM signals every process of a job step; a user may
`kill` one): the flags are summed over ranks with the step's loss, so all ranks act at the same step.
"""

from __future__ import annotations

import os
import signal

from ..errors import UserError, say

# Lazy import below: psutil only when workers are signalled; the CLI imports this module for Preempted.

# EX_TEMPFAIL from sysexits.h: "a temporary failure; the user is invited to retry".
REQUEUE_EXIT = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAVE_SIGNAL = signal.SIGUSR2


class Preempted(UserError):
    """A stop signal arrived; the run checkpointed and ends so that it can be requeued."""

    exit_code = REQUEUE_EXIT

    def __init__(self, what: str, step: int, checkpoint: str | None):
        where = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint could be written"
        super().__init__(f"stopped by {what} after step {step}; {where}", "run the same command with --resume auto (a `shardlab slurm` job requeues and resumes by itself)")

    def __str__(self) -> str:
        return f"{self.message} (to continue: {self.hint})"


class StopSignals:
    """Worker side: remember stop/save requests; the training loop acts on them between steps.

    The handlers only set flags, so a signal never interrupts a collective or a checkpoint write.
    Repeated signals are harmless (SLURM signals the launcher and the workers, and the launcher
    forwards what it gets).
    """

    def __init__(self) -> None:
        self.stop_signal: int | None = None
        self.save_requested = False
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        for sig in (*STOP_SIGNALS, SAVE_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == SAVE_SIGNAL:
            self.save_requested = True
            return
        if self.stop_signal is None:
            self.stop_signal = signum
            rank = os.environ.get("RANK", "0")
            say(f"[shardlab] rank {rank} got {signal.Signals(signum).name}: finishing the current step, then checkpointing")

    def take_save_request(self) -> bool:
        requested, self.save_requested = self.save_requested, False
        return requested

    def describe(self) -> str:
        return signal.Signals(self.stop_signal).name if self.stop_signal else "a stop signal on another rank"


class ForwardToWorkers:
    """Launcher side: pass SIGTERM/SIGUSR1/SIGUSR2 on to the worker processes and keep waiting for them.

    torch's elastic agent would turn SIGTERM into "SIGTERM the workers, SIGKILL them 30 s later";
    shardlab takes SIGTERM off the agent's list (LaunchConfig.signals_to_handle) so that workers get
    the time SLURM grants (KillWait/GraceTime) to finish the step and write the checkpoint.
    Without this handler SIGUSR1 would simply kill the launcher (its default action).
    """

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "ForwardToWorkers":
        for sig in (*STOP_SIGNALS, SAVE_SIGNAL):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame) -> None:
        import psutil

        for child in psutil.Process().children(recursive=False):
            try:
                child.send_signal(signum)
            except psutil.Error:  # already gone
                pass
