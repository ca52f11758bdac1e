"""Signals that end or checkpoint a run gracefully: SLURM's preemption warning and on-demand saves.

SLURM sends SIGTERM before it kills a job (preemption, `scancel`, `scontrol requeue`) and, with
`sbatch --signal=USR1@SECONDS`, SIGUSR1 that long before the time limit. Both mean: every rank
finishes its current optimizer step, a checkpoint is written, and the process exits with
REQUEUE_EXIT, which the script `shardlab slurm` writes turns into `scontrol requeue`; the requeued
job resumes with `--resume auto`. SIGUSR2 asks for a checkpoint without stopping.

A signal may reach one rank or all of them (SLURM signals every process of a job step; a user may
`kill` one): the flags are summed over ranks with the step's loss, so all ranks act at the same step.

SIGINT (Ctrl-C, or an IDE's or scheduler's stop sent to the `shardlab train` pid alone) stops the run the same way,
with a checkpoint only where the run asked for checkpoints (--save-every), and exit 130; a second SIGINT a moment
later stops at once. The launcher processes pass it on unless it came from their terminal, which sends it to every
process of the run itself.
"""

from __future__ import annotations

import os
import signal
import time

from ..errors import UserError, say

# Lazy import below: psutil only when workers are signalled; the CLI imports this module for Preempted.

# EX_TEMPFAIL from sysexits.h: "a temporary failure; the user is invited to retry".
REQUEUE_EXIT = 75
INTERRUPT_EXIT = 128 + signal.SIGINT  # as a shell reports a command ended by Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SAVE_SIGNAL = signal.SIGUSR2
# SIGINTs this close to the first are the same request arriving by several ways (the terminal, a launcher passing it
# on); a later one means "stop now".
SAME_SIGINT_S = 2.0


class Preempted(UserError):
    """A stop signal arrived: the run ends after a step. SIGTERM/SIGUSR1 checkpointed so that the job can be requeued
    (exit 75); SIGINT (``requeue`` False) checkpointed only if the run saves checkpoints, and exits 130."""

    exit_code = REQUEUE_EXIT

    def __init__(self, what: str, step: int, checkpoint: str | None, requeue: bool = True):
        if requeue:
            where = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint could be written"
            hint = "run the same command with --resume auto (a `shardlab slurm` job requeues and resumes by itself)"
        else:
            self.exit_code = INTERRUPT_EXIT
            where = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint written (the run saves none: --save-every N)"
            hint = ("run the same command with --resume auto" if checkpoint else
                    "start it again; with --save-every N a stopped run keeps a checkpoint to --resume from")
        super().__init__(f"stopped by {what} after step {step}; {where}", hint)

    def __str__(self) -> str:
        return f"{self.message} (to continue: {self.hint})"


def in_terminal_foreground() -> bool:
    """Whether this process runs in the foreground of its controlling terminal, whose Ctrl-C reaches every process
    of the run at once (so a SIGINT here need not be passed on)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:  # no controlling terminal: an IDE, a scheduler, a background job
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


class StopSignals:
    """Worker side: remember stop/save requests; the training loop acts on them between steps.

    The handlers only set flags, so a signal never interrupts a collective or a checkpoint write.
    Repeated signals are harmless (SLURM signals the launcher and the workers, and the launcher
    forwards what it gets).
    """

    def __init__(self) -> None:
        self.stop_signal: int | None = None
        self.save_requested = False
        self._stop_time = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        for sig in (*STOP_SIGNALS, SAVE_SIGNAL, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._previous.items():
            if not (sig == signal.SIGINT and self.stop_signal == signal.SIGINT):  # copies still on their way: not "stop now"
                signal.signal(sig, old)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == SAVE_SIGNAL:
            self.save_requested = True
            return
        if self.stop_signal is None:
            self.stop_signal, self._stop_time = signum, time.monotonic()
            rank = os.environ.get("RANK", "0")
            then = "checkpointing" if signum in STOP_SIGNALS else "stopping (Ctrl-C again to stop at once)"
            say(f"[shardlab] rank {rank} got {signal.Signals(signum).name}: finishing the current step, then {then}")
        elif signum == signal.SIGINT and time.monotonic() - self._stop_time > SAME_SIGINT_S:
            raise KeyboardInterrupt

    def take_save_request(self) -> bool:
        """A checkpoint asked for (SIGUSR2), or a stop by a signal that checkpoints (SIGTERM, SIGUSR1): read from the
        stop itself, so that a signal landing between reading the stop and this call is not half seen."""
        requested, self.save_requested = self.save_requested, False
        return requested or self.stop_signal in STOP_SIGNALS

    def describe(self) -> str:
        return signal.Signals(self.stop_signal).name if self.stop_signal else "a stop signal on another rank"


class ForwardToWorkers:
    """Launcher side: pass SIGTERM/SIGUSR1/SIGUSR2/SIGINT on to the worker processes and keep waiting for them.

    torch's elastic agent would turn SIGTERM into "SIGTERM the workers, SIGKILL them 30 s later";
    shardlab takes SIGTERM and SIGINT off the agent's list (LaunchConfig.signals_to_handle) so that workers get
    the time SLURM grants (KillWait/GraceTime) to finish the step and write the checkpoint.
    Without this handler SIGUSR1 would simply kill the launcher (its default action).
    """

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "ForwardToWorkers":
        for sig in (*STOP_SIGNALS, SAVE_SIGNAL, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame) -> None:
        import psutil

        children = psutil.Process().children(recursive=False)
        if signum == signal.SIGINT:
            if not children:  # nobody to stop gracefully yet (or any more): this process stops as Ctrl-C stops it
                raise KeyboardInterrupt
            if in_terminal_foreground():  # the terminal sent it to every process of the run already
                return
        for child in children:
            try:
                child.send_signal(signum)
            except psutil.Error:  # already gone
                pass
