"""A process that outlives the run: `shardlab train` watches its own training process from a small parent.

The kernel's out-of-memory killer ends a process with SIGKILL, which no handler can catch: a run that
trains in the process the user started (one GPU, one CPU worker) would end with the shell's "Killed"
and nothing else. So the `shardlab train` command re-runs its own command line as a child and only
waits for it (it imports neither torch nor the engines, so it costs a fraction of a second and a few
MB). When the child dies by a signal, the parent says so in one line: for SIGKILL with the peak host
memory the run's monitor recorded (cpu_memory.csv), the plan's prediction and what to change.

With several workers the elastic agent is the parent of the ranks and names a killed one
(launch.WorkerFailed); `note_for_kill` adds the same memory facts to its line. Inside a job that
another launcher started (torchrun, deepspeed, srun with several tasks) that launcher is the parent.

This module stays free of torch: the supervising process imports it.
"""

from __future__ import annotations

import csv
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import say
from ..measure.compile_stats import START_ENV, process_start_time
from ..measure.records import read_json, write_text_atomic
from ..specs.registry import find, lookup
from .bytecode import bytecode_env
from ..runtime.preemption import ForwardToWorkers
from ..runtime.process import in_launched_job
from .run_lock import remove_left_by_killed_run

# Lazy imports below: the supervising parent imports as little as it can (no torch: tests/test_layout_imports.py);
# psutil and the monitor's file name load only when a run was killed.

# Set in the supervised child: the file it writes its plan record into (run_plan.py), read after a kill.
SUPERVISED_ENV = "SHARDLAB_SUPERVISED"
GiB = 2**30


def wanted() -> bool:
    """Whether this `shardlab train` process should run its command again as a watched child."""
    return SUPERVISED_ENV not in os.environ and not in_launched_job() and hasattr(sys, "orig_argv")


def oom_kills() -> int | None:
    """The kernel's count of processes its out-of-memory killer has ended since boot (Linux >= 4.13), if readable."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def peak_host_gib(output_dir: str | Path) -> float | None:
    """The highest process-tree RSS in the run's cpu_memory.csv (the monitor streams it while the run goes)."""
    from ..measure.monitor import CPU_CSV

    path = Path(output_dir) / CPU_CSV
    try:
        with open(path, newline="") as f:
            values = [float(row["Real (MB)"]) for row in csv.DictReader(f) if row.get("Real (MB)")]
    except (OSError, ValueError, KeyError):
        return None
    return max(values) * 1e6 / GiB if values else None


def note_for_kill(output_dir: str | Path, plan: dict[str, Any] | None, oom_kills_before: int | None,
                  strategy: str | None) -> tuple[str, str]:
    """What is known about a SIGKILL, and the fix: did the OOM killer act, the peak host memory seen, the plan's prediction."""
    import psutil

    from ..measure.monitor import CPU_CSV

    parts = []
    after = oom_kills()
    memory_fix = fix_for_kill(strategy)
    fix = memory_fix
    if oom_kills_before is not None and after is not None and after > oom_kills_before:
        parts.append(f"the kernel's out-of-memory killer ended {after - oom_kills_before} process(es) during the run (/proc/vmstat oom_kill)")
    elif after is not None:  # the counter also counts kills at a cgroup's (container's, SLURM job's) memory limit
        parts.append("the kernel's out-of-memory killer did not act during the run (/proc/vmstat oom_kill unchanged), "
                     "so something else sent SIGKILL (kill -9, a job's time limit)")
        fix = f"find what sent it (the job's log, `sacct`); if it was about memory: {memory_fix}"
    else:
        parts.append("if nobody killed it: the kernel's out-of-memory killer or the job's memory limit (check `dmesg` or `sacct`)")
    peak = peak_host_gib(output_dir)
    ram = psutil.virtual_memory().total / GiB
    if peak is not None:
        parts.append(f"host memory (process-tree RSS, {Path(output_dir) / CPU_CSV}) peaked at {peak:.1f} GiB of {ram:.1f} GiB RAM")
    else:
        parts.append(f"host memory of the run was not recorded (it died before its run directory existed); this host has {ram:.1f} GiB RAM")
    predicted = (plan or {}).get("cpu_gib")
    if predicted is not None:
        parts.append(f"the plan predicted {predicted:.1f} GiB of host memory")
    elif plan and plan.get("error"):
        parts.append(f"no plan prediction ({plan['error']})")
    return "; ".join(parts), fix


def fix_for_kill(strategy: str | None) -> str:
    """What lowers a run's host memory, for a strategy."""
    fixes = ["a smaller --micro-batch (with a larger --grad-accum for the same global batch)"]
    s = lookup(strategy)
    if s is not None and s.offloads:
        fixes.append("--no-pin-memory")
        if "nvme" not in (s.offload_params, s.offload_optimizer):
            fixes.append(f"--strategy {find(engine='deepspeed', offload_optimizer='nvme')} (optimizer states on NVMe instead of host RAM)")
    fixes.append("a node or job with more host RAM (e.g. sbatch --mem)")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1]


# Sent to this process alone (`kill -HUP PID`, a test's SIGABRT): passed on, so that they reach the training as before.
FORWARDED = (signal.SIGHUP, signal.SIGQUIT, signal.SIGABRT)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (kill -9 of the PID a user started), so that the
    training stops as a SIGTERM stops it (checkpoint, exit) instead of running on unwatched."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(output_dir: str, strategy: str | None, command: list[str] | None = None) -> int:
    """Run ``command`` (default: this process's own command line again) as a child and wait for it. Returns its
    status as Popen does (negative: killed by that signal), after one line on stderr when a signal killed it."""
    with tempfile.TemporaryDirectory(prefix="shardlab-watch-") as tmp:
        plan_file = Path(tmp) / "plan.json"
        before = oom_kills()
        env = {**os.environ, **bytecode_env(os.environ), SUPERVISED_ENV: str(plan_file),  # bytecode.py: start-up halved
               START_ENV: repr(process_start_time())}  # the child's start-up clock runs from the command's start, not its own
        child = subprocess.Popen(command or [sys.executable, *sys.orig_argv[1:]], env=env,
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        # Ctrl-C reaches the child from the terminal itself; a SIGINT sent to this pid alone (an IDE's stop button, a
        # scheduler) is passed on (ForwardToWorkers); either way the child stops cleanly and we report its status. Not
        # while the child waits for the other nodes of a multi-node run (nodes_joining): that wait is a C++ call during
        # which no signal reaches the child's Python, so Ctrl-C and SIGTERM end it from here.
        ended: list[int] = []

        def end_if_joining(signum: int, frame) -> None:
            if nodes_joining(plan_file).exists():
                ended.append(signum)
                child.kill()
            else:
                forward._handle(signum, frame)

        previous = {signal.SIGINT: signal.signal(signal.SIGINT, end_if_joining)}
        for sig in FORWARDED:
            previous[sig] = signal.signal(sig, lambda signum, frame: child.send_signal(signum))
        try:
            with ForwardToWorkers() as forward:  # SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT sent to this process only (kill PID, SLURM's batch shell)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, end_if_joining)  # restored by ForwardToWorkers
                code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if ended:
            remove_left_by_killed_run(output_dir)  # its run wrote nothing yet: nor is anything left
            say(f"error: stopped by {signal.Signals(ended[0]).name} while waiting for the other nodes to join "
                "(no worker had started)")
            return 128 + ended[0]
        if code >= 0:
            return code
        sig = signal.Signals(-code)
        what = f"the training process (pid {child.pid}) was killed by {sig.name}"
        if sig == signal.SIGKILL:
            plan = read_json(plan_file)  # None: none written, or not whole
            note, fix = note_for_kill(output_dir, plan, before, strategy)
            say(f"error: {what}; {note} (fix: {fix})")
        else:
            say(f"error: {what}")
        return code


def exit_as(code: int) -> int:
    """End this process as the child ended: by the same signal (so that the shell, a bench or a test sees what they
    would have seen without the supervisor), else return the exit status."""
    if code >= 0:
        return code

    sys.stdout.flush()
    sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child left its core (if any); a second one of this parent helps nobody
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    return 128 - code  # a signal whose default is not to terminate (none kills a child that way)


def nodes_joining(plan_file: str | Path) -> Path:
    """The marker a supervised multi-node launcher leaves beside its plan file while its node waits for the others
    (launcher.spawn makes it; the first worker, or the end of the wait, removes it)."""
    return Path(plan_file).with_name("nodes-joining")


def mark_nodes_joining(joining: bool) -> None:
    """In a supervised child (or a worker it started): this node waits for the others to join, or no longer does."""
    path = os.environ.get(SUPERVISED_ENV)
    if path:
        marker = nodes_joining(path)
        marker.touch() if joining else marker.unlink(missing_ok=True)


def record_plan(plan: dict[str, Any]) -> None:
    """In a supervised child: leave the plan where the supervisor reads it after a kill."""
    path = os.environ.get(SUPERVISED_ENV)
    if path:
        write_text_atomic(path, json.dumps(plan))  # the kill it is for may come while it is written
