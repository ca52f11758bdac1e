"""Pin a rank's training thread (and the autograd engine's device threads) to one CPU of the rank's cores.

Why (benchmarks/results/*-h100-zero3-gc/): ZeRO-3 on one H100 is host-bound; its
step time follows the CPU. In backward, autograd runs the CUDA nodes, and with them DeepSpeed's Python hooks, on its own
device thread (`pt_autograd_0`). With that thread and the main thread on two different CPUs a step took 136 ms; with
both on one CPU 117 ms at the same CPU speed, and zero3 (block leaves, contiguous_gradients off) ran at 1.011x dp
(69.1k vs 68.4k tok/s, 3 runs, tight) against 0.80x unpinned in the same call. As the default
(benchmarks/results/*-h100-zero3-pin/): zero3 0.903x pinned dp vs 0.710x unpinned in one call, 0.698x
(2 runs) in the next: better, not yet robust. dp, GPU-bound (73-82 ms of host work under a 120 ms GPU step), lost
nothing: 1.008x / 0.997x of unpinned dp; zero1 / zero2 / fsdp pinned 1.150x / 0.988x / 1.086x dp.

How: Linux's sched_setaffinity(0, ...) (os.sched_setaffinity in CPython) sets the calling *thread's* mask, and every
thread or process created later inherits its creator's mask. So the pin is applied after the first training step,
when the things a run creates once already exist with the full mask: inductor's compile worker pool (the loss kernel
compiles in the first step, also in eager runs), NCCL's communicators, DeepSpeed's op loads, torch's OpenMP pool
(warmed here before the pin), and the autograd device threads, which are then pinned explicitly by their thread id.
Whatever the pinned thread creates afterwards gets the rank's full set back: Python threads (`threading.Thread.start`)
and processes (`os.fork` through at-fork hooks; `subprocess` and multiprocessing's spawn, which exec without running
at-fork hooks, and `os.posix_spawn`) are created with the thread's mask widened for the moment of creation
(compat/thread_spawn.py wraps them while a thread is pinned). Threads that
C++ code creates later from the pinned thread (a CUDA driver or NCCL thread for a new communicator) are the gap; none
is created in the steady loop. The pin is released (full mask back on both threads) when the loop ends.

Scope (`pin_thread`): 'auto' pins only what was measured to gain or not to lose: CUDA runs of dp, zero1-3 and fsdp with
the optimizer on the GPU (no offload of any kind: DeepSpeed's CPU-Adam and torchao's offload run OpenMP work whose pool
may be created after the pin), eager (--compile's graph can recompile with the compile pool being created later; not
measured), one or more ranks per node as long as each rank owns a CPU of its own. 'on' also pins compiled runs and
the other GPU strategies without offload; 'off' never pins.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .. import compat
from ..compat import thread_spawn
from .distributed import rank_share


def pin_decision(cfg, device_type: str, local_rank: int = 0, local_world: int = 1,
                 cores: list[int] | None = None) -> tuple[int | None, str]:
    """(the CPU to pin this rank's training thread to, or None; why). `cores`: the CPUs this rank may run on
    (default: the calling thread's mask), split among the node's ranks as bind_threads_to_rank_cores splits them
    (distributed.rank_share)."""
    from ..specs.registry import spec

    mode = cfg.pin_thread
    if mode == "off":
        return None, "pin_thread off"
    s = spec(cfg.strategy)
    if device_type != "cuda":
        return None, "not a CUDA run"
    if s.offloads or s.engine == "torchao":
        return None, f"{cfg.strategy} steps or keeps state on the CPU (its OpenMP/CPU-Adam threads need the cores)"
    if mode == "auto":
        if not s.pin_measured:  # dp, zero1-3, fsdp: benchmarks/results/*-h100-zero3-pin/
            return None, f"auto: {cfg.strategy} was not measured pinned"
        if cfg.compile:
            return None, "auto: --compile runs were not measured pinned"
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    mine = rank_share(cores, local_rank, local_world)
    if not mine:
        return None, f"{local_world} ranks on {len(cores)} CPUs: no CPU of its own per rank"
    if not compat.enabled("thread_spawn"):  # what keeps new threads and processes off the one CPU
        return None, f"patch thread_spawn off: {compat.why_off('thread_spawn')}"
    # The last CPU of the share, not whichever the thread happens to be on: a choice the summary can report and a rerun
    # repeats. (It is not a speed-up of its own: pinned to CPU 15 of 16, zero3 ran 0.92/0.90/0.78x dp on one machine
    # and 0.61/0.59/0.56x on another; benchmarks/results/*-h100-zero3-pin/, call 3.)
    return mine[-1], f"pin_thread {mode}"


def autograd_threads() -> list[int]:
    """Thread ids of this process's autograd device threads (torch names them pt_autograd_<device>)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("pt_autograd"):
                    out.append(int(tid))
        except OSError:
            continue
    return out


def _warm_openmp_pool() -> None:
    """Make torch's intra-op OpenMP threads exist before the pin (a parallel region creates them; they would inherit
    the one-CPU mask if first made by the pinned thread)."""
    import torch

    if torch.get_num_threads() > 1:
        torch.ones(1 << 20).mul_(2.0)  # one element-wise op well over at::internal::GRAIN_SIZE: runs in parallel


class _State:
    lock = threading.Lock()
    ident: int | None = None  # the pinned thread (threading.get_ident()), None when nothing is pinned
    pinned: set[int] = set()
    others: list[int] = []  # the other threads pinned with it (autograd's device threads)
    full: set[int] = set()
    depth = 0  # nested widenings (a Popen whose preexec_fn forks, ...)


def _widen() -> bool:
    if _State.ident is None or threading.get_ident() != _State.ident:
        return False
    _State.depth += 1
    if _State.depth == 1:
        os.sched_setaffinity(0, _State.full)
    return True


def _narrow() -> None:
    _State.depth -= 1
    if _State.depth == 0 and _State.ident is not None:
        os.sched_setaffinity(0, _State.pinned)


def _forget_in_child() -> None:
    _State.depth, _State.ident = 0, None  # a forked child's thread is not the pinned one (its mask is already full)


def pin(cpu: int, threads: list[int] | None = None) -> dict[str, Any]:
    """Pin the calling thread and `threads` (default: the autograd device threads) to `cpu`; what was pinned."""
    with _State.lock:
        if _State.ident is not None:
            raise RuntimeError("a thread is already pinned")
        _warm_openmp_pool()
        thread_spawn.install(_widen, _narrow, _forget_in_child)
        _State.full = set(os.sched_getaffinity(0))
        _State.pinned = {cpu}
        others = autograd_threads() if threads is None else threads
        os.sched_setaffinity(0, _State.pinned)
        _State.ident = threading.get_ident()
        done = []
        for tid in others:
            try:
                os.sched_setaffinity(tid, _State.pinned)
                done.append(tid)
            except OSError:  # the thread ended meanwhile
                continue
        _State.others = done
        return {"cpu": cpu, "threads": 1 + len(done), "full_set": len(_State.full)}


def release() -> None:
    """Give the pinned thread and the others pinned with it the full set back."""
    with _State.lock:
        if _State.ident is None:
            return
        full = _State.full
        for tid in _State.others:
            try:
                os.sched_setaffinity(tid, full)
            except OSError:
                pass
        if threading.get_ident() == _State.ident:
            os.sched_setaffinity(0, full)
        _State.ident, _State.others, _State.depth = None, [], 0
        thread_spawn.uninstall()


def is_pinned() -> bool:
    return _State.ident is not None
