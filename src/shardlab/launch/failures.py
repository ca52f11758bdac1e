"""How a worker process failed, told in one line: the exception the launcher raises and the CLI reports, and
`report_errors`, which turns every user-facing failure into one line and an exit status (the CLI and each worker).

Its own module, free of torch, because `shardlab train`'s supervising parent (supervise.py) catches it too and
must start in a fraction of a second: importing the launcher would load torch (3 s) in a process that only waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

from ..errors import UserError, say
from ..runtime.preemption import INTERRUPT_EXIT, REQUEUE_EXIT, Preempted


def _cause_order(rank: int, failure, requeue_exit: int) -> tuple:
    """Sort key of a launcher's failures: the first is the cause.

    `timestamp` is when the launcher's poll (every monitor_interval) saw the exit, in whole seconds: a killed
    rank and the survivor that then lost its peer are usually seen by the same poll, so the time cannot order
    them and how each ended does. A signal death is the cause (a survivor exits on its own, with an error);
    SIGABRT after the other signals (a native abort is also how a survivor may end while its broken group is
    torn down); SIGTERM last of all, since it is how the launcher stops the ranks still running after a
    failure; a checkpoint-and-stop exit (requeue) is the cause only when nothing else failed. Then the rank."""
    code = failure.exitcode
    if code == -signal.SIGTERM:
        kind = 4
    elif code < 0:
        kind = 1 if code == -signal.SIGABRT else 0
    else:
        kind = 3 if code in (requeue_exit, INTERRUPT_EXIT) else 2
    return failure.timestamp, kind, rank


class WorkerFailed(Exception):
    """A worker exited non-zero. A worker that raised printed its own error; one that was killed is named here."""

    def __init__(self, exitcode: int, message: str | None = None):
        super().__init__(message or f"a worker process failed with exit code {exitcode} (its error is printed above)")
        self.exitcode = exitcode if exitcode and exitcode > 0 else 1

    @classmethod
    def from_failures(cls, failures: dict) -> "WorkerFailed":
        """The failure that caused the others, chosen by how each rank ended (see `_cause_order`)."""
        if not failures:
            return cls(1)
        rank, first = min(failures.items(), key=lambda kv: _cause_order(kv[0], kv[1], REQUEUE_EXIT))
        if first.exitcode == REQUEUE_EXIT:  # ranks stop at the same step, so the first to exit speaks for all
            return cls(REQUEUE_EXIT, "the workers checkpointed and stopped on a signal (exit 75: requeue and resume with --resume auto)")
        if first.exitcode == INTERRUPT_EXIT:
            return cls(INTERRUPT_EXIT, "the workers stopped on SIGINT (exit 130)")
        if first.exitcode < 0:  # killed by a signal: it could not say so itself
            name = first.signal_name()
            why = ""
            if name == "SIGKILL":  # nobody on a cluster sends it by hand: usually the kernel's OOM killer or a job limit
                why = (" (if nobody killed it: the host's out-of-memory killer or the job's memory limit; check `dmesg` or "
                       "`sacct`, and lower --micro-batch, or use --no-pin-memory / a strategy that offloads less)")
            return cls(128 - first.exitcode, f"rank {rank} (pid {first.pid}) was killed by {name}; the other ranks were stopped{why}")
        return cls(first.exitcode, f"a worker process failed with exit code {first.exitcode} (rank {rank}; its error is printed above)")


@dataclass
class _Status:
    code: int = 0


@contextlib.contextmanager
def report_errors():
    """Turn user mistakes into one line on stderr and a non-zero status; bugs keep their traceback."""
    status = _Status()
    try:
        yield status
    except Preempted as err:  # not a failure: the run checkpointed and wants to be requeued
        if os.environ.get("RANK") in (None, "0"):
            say(f"[shardlab] {err}")
        status.code = err.exit_code
    except UserError as err:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        say(f"{prefix}error: {err}")
        status.code = err.exit_code
    except WorkerFailed as err:  # a stop the user or the scheduler asked for is no error
        say(f"{'[shardlab]' if err.exitcode in (REQUEUE_EXIT, INTERRUPT_EXIT) else 'error:'} {err}")
        status.code = err.exitcode
    except KeyboardInterrupt:
        say("interrupted")
        status.code = 130
