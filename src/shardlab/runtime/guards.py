"""When another rank dies or hangs: fail fast, in one line, naming the rank where it can be known.

A rank that dies breaks its connections: gloo fails the next collective at once, NCCL soon after
(its watchdog); a rank that hangs makes the others wait `dist_timeout_s` (init_process_group's
timeout) before the collective fails. The launcher of the node where a worker died knows which
rank it was and how it ended (launch.WorkerFailed); it also leaves that line in the job's
rendezvous store, where the ranks of the *other* nodes look for it when their collective fails.
"""

from __future__ import annotations

import datetime
import os

import torch
from torch.distributed import TCPStore

from ..errors import UserError

FAILURE_KEY = "shardlab/failure"
_COMM_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "NCCL", "gloo", "Socket", "Broken pipe")


def is_comm_failure(err: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and any(m in str(err) for m in _COMM_MARKERS))


def _store(host: str, port: int, timeout_s: float):
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def publish_failure(host: str, port: int, run_id: str, message: str) -> None:
    """Launcher side, best effort: tell the other nodes which rank failed."""
    try:
        _store(host, port, 3).set(f"{FAILURE_KEY}/{run_id}", message)
    except Exception:  # noqa: BLE001 - the store may be gone with node 0; the local message stands
        pass


def read_failure(wait_s: float = 3.0) -> str | None:
    """Worker side: the failure a launcher published, if one arrives within `wait_s`."""
    host, port, run_id = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("TORCHELASTIC_RUN_ID")
    if not (host and port and run_id):
        return None
    try:
        store = _store(host, int(port), wait_s)
        key = f"{FAILURE_KEY}/{run_id}"
        store.wait([key], datetime.timedelta(seconds=wait_s))
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 - nothing published (a hang, or the store's host is gone)
        return None


def comm_failure(err: BaseException, rank: int, timeout_s: float) -> UserError:
    """The one line a surviving rank prints instead of a collective's traceback."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = read_failure()
    if cause:
        what = f"{cause} (reported by its node's launcher)"
    elif "timed out" in text.lower() or "timeout" in text.lower():
        what = f"a collective waited more than {timeout_s:g} s (dist_timeout_s): some rank hung or is far behind"
    else:
        what = "another rank died (its node's launcher names it)"
    return UserError(f"rank {rank} lost the other ranks: {what}; collective error: {text[:160]}", "check the failing rank's log; resume with --resume auto")
