"""Run a command in a process group of its own and end the whole group on a timeout or an interrupt.

The one owner of this for `shardlab bench` (bench.runner.run_one: every repeat is a fresh
`shardlab train`) and `--micro-batch auto` (autobatch.subprocess_trial: every trial is one). A run's
launcher spawns ranks; killing the launcher alone would leave them behind, so the command gets its
own session and a timeout or a Ctrl-C signals the group: every process it spawned, and nothing else.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import IO, Any, Sequence

REAP_WAIT_S = 5.0  # after SIGKILL: how long to wait for the group's leader to be gone


@dataclass
class GroupRun:
    code: int  # exit status as Popen gives it (negative: ended by that signal)
    timed_out: bool  # the timeout went off and ended the group
    usage: resource.struct_rusage  # wait4's: ru_maxrss is the largest resident set of the leader and the children it reaped


def _signal_group(pid: int, sig: int) -> bool:
    """Signal the process group `pid` leads; False when it is gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def end_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """SIGTERM the group and give its leader `grace` seconds to exit, then SIGKILL it; grace 0: SIGKILL at once."""
    steps = ((signal.SIGTERM, grace),) if grace else ()
    for sig, wait in (*steps, (signal.SIGKILL, REAP_WAIT_S)):
        if not _signal_group(proc.pid, sig):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_group(cmd: Sequence[str], *, stdout: IO[Any] | int | None, stderr: IO[Any] | int | None, env: dict[str, str] | None,
              timeout: float, grace: float = 0.0) -> GroupRun:
    """Run `cmd` (stdin closed) in its own session, waiting at most `timeout` seconds; then end its group as
    end_group does (SIGTERM, `grace` seconds, SIGKILL; grace 0: SIGKILL at once). An exception while waiting
    (KeyboardInterrupt) ends the group the same way and is raised again: nothing is left behind.

    The wait is wait4, not Popen.wait, so that the caller also gets the leader's resource usage (peak RSS);
    the timeout therefore runs in a timer thread that only sends signals, and this thread alone reaps.
    """
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    timed_out, done = threading.Event(), threading.Event()

    def kill_later() -> None:
        if not done.is_set():
            _signal_group(proc.pid, signal.SIGKILL)

    def on_timeout() -> None:
        timed_out.set()
        if grace:
            _signal_group(proc.pid, signal.SIGTERM)
            second = threading.Timer(grace, kill_later)
            second.daemon = True
            second.start()
        else:
            kill_later()

    timer = threading.Timer(timeout, on_timeout)
    timer.daemon = True
    timer.start()
    try:
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
    except BaseException:  # interrupted: do not leave the run behind
        done.set()  # stops a pending second timer; end_group reaps
        end_group(proc, grace)
        raise
    done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return GroupRun(proc.returncode, timed_out.is_set(), usage)


__all__ = ["GroupRun", "run_group", "end_group"]
