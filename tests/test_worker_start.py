"""How spawned ranks start (launch/launcher.worker_start_method, launch/worker.forked_main): forked from the launcher on
CPU, fresh interpreters on GPUs; a forked rank starts with what a fresh interpreter has, not the launcher's handlers."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import signal

from shardlab.launch import worker
from shardlab.launch.launcher import WORKER_START_ENV, worker_start_method


def test_cpu_runs_fork_their_ranks_gpu_runs_exec_them(monkeypatch):
    monkeypatch.delenv(WORKER_START_ENV, raising=False)
    assert worker_start_method("cpu") == "fork"
    assert worker_start_method("cuda") == "exec"  # a forked child cannot initialise CUDA again
    monkeypatch.setenv(WORKER_START_ENV, "exec")
    assert worker_start_method("cpu") == "exec"
    monkeypatch.setenv(WORKER_START_ENV, "bogus")  # anything else: the default
    assert worker_start_method("cpu") == "fork"


def _seen_by_rank(queue) -> None:
    def fake_main(argv):
        queue.put({"argv": argv, "name": open("/proc/self/comm").read().strip(), "term": signal.getsignal(signal.SIGTERM), "usr1": signal.getsignal(signal.SIGUSR1),
                   "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler})
        atexit.register(queue.put, "rank's own exit hook ran")
        return 0

    worker.main = fake_main
    import os

    os.environ["RANK"] = "3"  # as torch's elastic wrapper sets it in the child before calling the entry
    worker.forked_main("config.yaml", "plan.json")


def test_a_forked_rank_drops_the_launchers_handlers_and_exit_hooks():
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    previous = {s: signal.signal(s, lambda *a: None) for s in (signal.SIGTERM, signal.SIGUSR1)}  # as ForwardToWorkers
    atexit.register(queue.put, "launcher's exit hook")  # would reach the queue if the rank ran it
    try:
        proc = ctx.Process(target=_seen_by_rank, args=(queue,))
        proc.start()
        seen, last = queue.get(timeout=60), queue.get(timeout=60)
        proc.join(60)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        atexit.unregister(queue.put)
    assert proc.exitcode == 0
    assert seen == {"argv": ["config.yaml", "plan.json"], "name": "shardlab-r3", "term": signal.SIG_DFL, "usr1": signal.SIG_DFL, "int": True}
    assert last == "rank's own exit hook ran"
    assert queue.empty()
