"""`python -m shardlab.launch.worker CONFIG.yaml RESOLVED.json [PLAN.json]`: the body of one spawned worker process (GPU
runs); `forked_main`: the same body in a rank forked from the launcher (CPU runs, launcher.worker_start_method). The
rank runs the config as the launcher resolved it (RESOLVED.json: shardlab.runtime.resolved.ResolvedRun.record)."""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from .failures import report_errors
from ..config import load_config
from ..runtime.distributed import exit_process
from .supervise import mark_nodes_joining

# The imports inside main() run inside report_errors, so that an error raised while they import is reported as one
# raised while training is.


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mark_nodes_joining(False)  # a worker exists (exec'd or forked), so the nodes have joined: Ctrl-C stops the run as usual
    with report_errors() as status:
        from ..planning.run_plan import read_record
        from ..loop.trainer import run_worker
        from ..runtime.resolved import ResolvedRun

        run = ResolvedRun.from_record(load_config(argv[0]), json.loads(Path(argv[1]).read_text()))
        run_worker(run, plan=read_record(argv[2]) if len(argv) > 2 else None)
    return status.code


def name_process(name: str) -> None:
    """Linux: the process's name as `ps`/`top` and psutil's name() show it (15 bytes). A forked rank has the launcher's
    command line and environment in /proc (its RANK is set in-process only), so this is what tells the ranks apart."""
    if sys.platform == "linux":
        PR_SET_NAME = 15
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def forked_main(*argv: str) -> None:
    """A rank forked from the launcher (launcher.worker_start_method): start as a fresh interpreter would. The
    launcher's handlers (forwarding SIGTERM/SIGUSR*, the elastic agent's SIGINT/SIGHUP/SIGQUIT) and its exit hooks
    are not this rank's; its own exit hooks run at the end, as `sys.exit` runs them in an exec'd worker (the
    multiprocessing child that called us ends in os._exit)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()
    name_process(f"shardlab-r{os.environ.get('RANK', '?')}")
    try:
        code = main(list(argv))
    except Exception:  # a bug: its traceback, as an exec'd rank's interpreter prints it (the fork's parent records only
        traceback.print_exc()  # its exit code)
        sys.stderr.flush()
        code = 1
    atexit._run_exitfuncs()
    if code:
        exit_process(code)


if __name__ == "__main__":
    exit_process(main())
