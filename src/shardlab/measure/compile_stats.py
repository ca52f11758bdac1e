"""torch.compile accounted for: how long compiling took, whether the graph caches were hit, where they live.

Compile time is torch's own measure, not an estimate from step times: dynamo records the wall time
of each timed compile phase in ``torch._dynamo.utils.compilation_time_metrics`` ({phase: [seconds]}).
``_compile.compile_inner`` is one frame's whole compile (tracing, AOTAutograd, inductor's forward
graph, in the step that first runs it); the backward graph is compiled lazily at the first backward,
outside it, under ``...bw_compiler``. Their sum is the compile time (nested phases are not added
again). The counters say whether inductor's FX graph cache and the AOTAutograd cache were hit.

Both caches are on by default but live in ``/tmp/torchinductor_<user>``, which a fresh machine or a
cleaned /tmp loses; ``use_persistent_cache`` points inductor at shardlab's cache directory instead
(unless TORCHINDUCTOR_CACHE_DIR is set), so a second run of the same configuration loads its graphs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import psutil

from ..cachedir import cache_root

# Lazy imports below: torch._dynamo is slow to import even after torch, and only compiled runs read its figures.

__all__ = ["use_persistent_cache", "limit_compile_workers", "compile_workers", "compile_pool_bytes", "found_every_graph",
           "compared_with_cached_plan",
           "COMPILE_WORKER_RSS_BYTES", "COMPILE_POOL_RSS_BYTES", "COMPILE_GROWTH_BYTES", "INPROCESS_COMPILE_RSS_BYTES", "CompileClock",
           "process_start_time", "mark_start", "START_ENV"]

# Wall-clock time (time.time()) at which the user's command started; the launcher sets it for its workers.
START_ENV = "SHARDLAB_START_TIME"


def use_persistent_cache(sdpa_backend: str = "auto") -> Path:
    """Inductor's cache directory: $TORCHINDUCTOR_CACHE_DIR if set, else <shardlab cache>/inductor (set here,
    before anything compiles, so worker processes inherit it). Returns the directory in use.

    A run that picks an attention kernel (``sdpa_backend`` other than auto) gets the subdirectory ``sdpa-<choice>``:
    the AOTAutograd cache's key ignores torch's SDPA backend flags, so a shared directory would hand it graphs traced
    with another kernel (training/attention_backend.py). Idempotent: a worker inheriting the launcher's directory
    keeps it."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    path = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    if sdpa_backend != "auto" and not path.name.startswith("sdpa-"):
        path = path / f"sdpa-{sdpa_backend}"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


# Resident memory of inductor's compile pool, per training process: a fixed part (the process that owns the pool,
# started first, and what the workers grow by as they compile) and one part per worker (a Python with torch imported).
# A pool of N workers measured (process tree minus the ranks and the launcher, GiB): N = 16 on an H100 host, 7.22 and
# 7.63 (benchmarks/results/*-h100-big-model, calls 2-3); N = 32 on a 32-core 2 x H200 host, 13.56 (llama-3.2-1b, one
# GPU), 12.92 (the same, two), 13.42 (bloom-7b1) and 13.38 (llama-2-13b) per rank (*-h200x2-scaling, calls 5-6).
# Per worker 0.37: the tree's jump as the 16 workers start (5.81-5.98 GiB), which the two pool sizes' difference agrees
# with (0.37 GiB a worker); the owner process 0.40 at its start; the fixed 1.55 is fitted (the owner and the growth).
# A flat 0.5 per worker, fitted to the H100 pools alone, put the H200 nodes 15-20% high.
COMPILE_WORKER_RSS_BYTES = int(0.37 * 2**30)
COMPILE_POOL_RSS_BYTES = int(1.55 * 2**30)
# Of the fixed part, what the workers grow by as they compile (1.55 less the owner's 0.40): a run whose graphs are all in
# inductor's cache compiles no kernel, and its pool stays that much smaller. Measured, the cold run's process tree less
# the cached one's, the same configuration: 1.73 GiB (llama-3.2-1b fsdp, 32 workers, 2 x H200 host,
# *-h200x2-scaling-bars), 1.32 GiB (gpt2-large fsdp, 16 workers, 1 H200, *-h200-fsdp-units).
COMPILE_GROWTH_BYTES = int(1.15 * 2**30)
# What compiling in the training process adds to its own resident memory (dynamo, inductor, Triton and the compiled
# kernels): 8-bit AdamW runs on one H100, rank RSS minus the pinned copies the first step gave back, 2.20-2.23 GiB
# against the 1.93 of an eager process (planning/host.GPU_PROCESS_RSS_BYTES): 13B 4.70 - 2.5, bloom-7b1 10.22 - 8.0 and
# 9.23 - 7.0 (benchmarks/results/*-h100-remeasure, calls 1 and 4). Measured directly once shardlab compiled
# that step before training, without copies: 2.14-2.26 GiB against 2.21 planned (benchmarks/results/*-h100-8bit-warmup).
INPROCESS_COMPILE_RSS_BYTES = int(0.28 * 2**30)
COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def limit_compile_workers(compile_model: bool) -> None:
    """Without ``--compile`` a run compiles only small graphs (the loss kernel, torchao's optimizer step), yet inductor
    starts a pool of min(32, cores) worker processes for them, ~0.4 GiB of host memory each: 7.2-7.6 GiB on a 16-core node,
    which pushed bloom-7b1 zero3_offload over the 125 GiB host it was planned to fit (OOM-killed at 128.2 GiB in its
    first step). Those runs compile in-process instead (TORCHINDUCTOR_COMPILE_THREADS=1; set here before anything
    compiles, inherited by the workers). A value the user set is kept; ``--compile`` runs keep the pool, whose
    parallel compile pays for a whole model, and the planner counts it (``compile_workers``)."""
    if not compile_model:
        os.environ.setdefault(COMPILE_THREADS_ENV, "1")
    # Inductor reads the variable once, when its config is imported; a process that imported it before this ran
    # (a notebook that compiled something, DeepSpeed's ZeRO optimizer check importing its Muon module) has decided
    # already, so the value goes to the config too.
    config = sys.modules.get("torch._inductor.config")
    if config is not None and os.environ.get(COMPILE_THREADS_ENV):
        config.compile_threads = int(os.environ[COMPILE_THREADS_ENV])


def compile_workers(compile_model: bool, cpus: int | None = None) -> int:
    """Inductor compile worker processes per training process (the planner's host memory), as inductor decides them
    (torch._inductor.config.decide_compile_threads) after ``limit_compile_workers``; 0 when it compiles in-process."""
    if COMPILE_THREADS_ENV in os.environ:
        threads = int(os.environ[COMPILE_THREADS_ENV])
    elif not compile_model:
        threads = 1
    else:
        threads = min(32, cpus or os.cpu_count() or 1)
    return threads if threads > 1 else 0


def compile_pool_bytes(workers: int, cached: bool = False) -> float:
    """Host bytes of a pool of ``workers`` inductor compile workers (none: nothing); ``cached``: of a run whose graphs
    are all in inductor's cache, so that the workers compile nothing."""
    if not workers:
        return 0.0
    return float(COMPILE_POOL_RSS_BYTES - (COMPILE_GROWTH_BYTES if cached else 0) + workers * COMPILE_WORKER_RSS_BYTES)


def found_every_graph(compile_cache: dict[str, Any] | None) -> bool:
    """Whether a run's compile (its summary's ``compile_cache``) found every graph inductor would compile in the cache:
    FX-graph hits and no miss, so its workers compiled no kernel. An AOTAutograd miss alone still finds the FX graph."""
    cc = compile_cache or {}
    return bool(cc.get("fx_graph_hit")) and not cc.get("fx_graph_miss")


def compared_with_cached_plan(cpu_gib_cached: float | None, compile_cache: dict[str, Any] | None) -> bool:
    """Whether a run's measured host memory compares with its plan's cached figure (``plan.cpu_gib_cached``, given
    where a compile pool runs) rather than ``plan.cpu_gib``: it found every graph in the cache (``found_every_graph``)."""
    return cpu_gib_cached is not None and found_every_graph(compile_cache)


def process_start_time() -> float:
    """When the command started (time.time() scale): the launcher's start when it spawned this worker, else
    this process's creation time as the OS records it (so interpreter start-up and imports are included)."""
    if os.environ.get(START_ENV):
        return float(os.environ[START_ENV])

    return psutil.Process(os.getpid()).create_time()


def mark_start(at: float | None = None) -> None:
    """Record the command's start for this process and the workers it spawns (no-op when a launcher above already
    did): ``at`` (time.time() scale), else this process's creation. A library call passes its own start: a notebook's
    process may have been created hours before."""
    if not os.environ.get(START_ENV):
        os.environ[START_ENV] = repr(process_start_time() if at is None else at)


def _compile_seconds() -> float:
    if "torch._dynamo.utils" not in sys.modules:  # nothing compiled yet; importing dynamo would cost an eager run ~1 s
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(v) for k, v in compilation_time_metrics.items() if k == "_compile.compile_inner" or k.endswith("bw_compiler"))


def _cache_counts() -> dict[str, int]:
    if "torch._dynamo.utils" not in sys.modules:
        return dict.fromkeys(("fx_graph_hit", "fx_graph_miss", "aot_autograd_hit", "aot_autograd_miss"), 0)
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_graph_hit": inductor["fxgraph_cache_hit"], "fx_graph_miss": inductor["fxgraph_cache_miss"],
            "aot_autograd_hit": aot["autograd_cache_hit"], "aot_autograd_miss": aot["autograd_cache_miss"]}


class CompileClock:
    """Compile seconds and cache hits since it was made (a process may have compiled before, e.g. a trial run)."""

    def __init__(self) -> None:
        self._t0, self._c0 = _compile_seconds(), _cache_counts()

    def seconds(self) -> float:
        return _compile_seconds() - self._t0

    def summary(self) -> dict[str, Any]:
        counts = {k: v - self._c0[k] for k, v in _cache_counts().items()}
        hits, misses = counts["fx_graph_hit"] + counts["aot_autograd_hit"], counts["fx_graph_miss"] + counts["aot_autograd_miss"]
        return {
            "compile_time_s": self.seconds(),
            "compile_time_source": "torch._dynamo.utils.compilation_time_metrics (_compile.compile_inner + bw_compiler)",
            "compile_cache": {**counts, "hit": hits > 0 and misses == 0 if hits + misses else None,
                              "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")},
        }
