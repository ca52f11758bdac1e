"""What the DeepSpeed names (strategies/deepspeed_zero.py: zero0-3, their offload twins, infinity) hold, buffer by
buffer as DeepSpeed 0.19.8 allocates them (runtime/zero/stage_1_and_2.py and stage3.py): 16-bit parameters and
gradients and an fp32 master with AdamW's m and v (12 B), sharded per stage; the buckets, the partial offload's GPU
sub-groups, ZeRO-3's gathered parameters; the host partitions of ZeRO-Offload; DeepSpeed's own estimator. The engine's
settings it follows (sized_buckets, overlap_comm, contiguous_gradients, ...) are strategies/deepspeed_config.py's."""

from __future__ import annotations

import math
from fractions import Fraction

from ..deepspeed_config import (block_leaves, contiguous_gradients, gpu_grad_accum_fp32, one_rank_shortcuts, overlap_comm,
                               sized_buckets)
from ...specs.registry import StrategySpec
from ...specs.deepspeed_zero import NVME_BYTES_PER_PARAM
from . import EngineMemory, Held, Run, States, built_on_meta, cpu_adamw_temp_bytes, pinned_bytes

# DeepSpeed's default AIO swap buffers for ZeRO-Infinity (deepspeed/runtime/swap_tensor/constants.py &
# zero/offload_config.py): offload_param buffer_count 5 x buffer_size 1e8 elements (16-bit); the
# optimizer swapper keeps buffer_count 4 x (largest sub-group, 1e9 elements by default, capped at the
# partition) fp32. Approximate; pinned CPU memory.
INFINITY_PARAM_BUFFERS = 5 * 100_000_000 * 2
# DeepSpeed's import and engine add to a CPU rank's resident baseline: zero1/2/3(_offload) tiny-gpt2 runs peaked
# 0.06-0.09 GiB above the same prediction for dp on the same machine.
CPU_DEEPSPEED_RSS_BYTES = int(0.07 * 2**30)
TIED = "end of backward (all gradients + the tied embedding's second gradient)"


def ds_group_params(arch, weight_decay: float) -> list[list[int]]:
    """Element counts of the parameters of DeepSpeed's parameter groups, in model order (optim.param_groups:
    matrices decay, 1-D tensors not; one group without weight decay)."""
    if not arch.param_sizes:
        return [[arch.n_params]]
    if weight_decay == 0:
        return [[k for k, _ in arch.param_sizes]]
    groups = ([k for k, dim in arch.param_sizes if dim >= 2], [k for k, dim in arch.param_sizes if dim < 2])
    return [g for g in groups if g]


def zero3_sub_groups(group_partitions: list[list[int]], sub_group_size: int) -> list[int]:
    """Element counts of ZeRO-3's optimizer sub-groups on one rank, as DeepSpeed 0.19.8 cuts them
    (runtime/zero/stage3.py ``_create_fp16_sub_groups``, l.1210-1233). `group_partitions`: each optimizer param group's
    per-parameter partition sizes (``partition_numel``: ceil(numel / ranks)), in the group's order. A group no larger
    than `sub_group_size` is one sub-group; otherwise parameters are appended until the sub-group holds at least
    `sub_group_size` elements (so it overshoots by up to one parameter) or the group ends. Groups never share one."""
    out: list[int] = []
    for parts in group_partitions:
        if sub_group_size >= sum(parts):
            out.append(sum(parts))
            continue
        size = 0
        for i, k in enumerate(parts):
            size += k
            if size >= sub_group_size or i == len(parts) - 1:
                out.append(size)
                size = 0
    return out


def twin_flow_gpu_sub_groups(count: int, ratio: float) -> int:
    """How many of ZeRO-3's `count` sub-groups partial offload (``offload_optimizer.ratio``) keeps on the accelerator:
    the first ``int((1 - ratio) * count)``, rounded down as float arithmetic gives it (stage3.py
    ``_create_fp32_partitions``, l.1100-1108: sub-group i goes to the CPU when i >= that). So ratio 0.5 of 11
    sub-groups keeps 5, and 0.9 of 10 keeps none ((1 - 0.9) * 10 = 0.999...)."""
    return int((1 - ratio) * count)


def optimizer_split(run: Run) -> tuple[list[int], list[int]]:
    """A ZeRO-3 offload rank's optimizer sub-groups (elements each), as (kept on the GPU, on the host).

    The sub-groups are DeepSpeed's cut (zero3_sub_groups) at the sub_group_size the strategy writes into the JSON
    (sized_buckets). Partial offload (``--offload-ratio``, DeepSpeed's ``offload_optimizer.ratio``, zero3_offload only)
    keeps the first ``twin_flow_gpu_sub_groups`` of them on the accelerator. On a CPU-only run DeepSpeed's
    "accelerator" is the CPU (cpu_accelerator.py: ``_name = 'cpu'``), so every sub-group is host memory and steps in
    CPU Adam whatever the ratio."""
    s, d = run.spec, run.world
    parts = [[math.ceil(k / d) for k in g] for g in ds_group_params(run.arch, run.cfg.weight_decay)]
    size = sized_buckets(run.opts, run.n, run.arch.hidden, s.offload_optimizer)["sub_group_size"]
    subs = zero3_sub_groups(parts, size)
    on_gpu = 0
    if run.device == "cuda" and s.offload_optimizer == "cpu":  # build_ds_config writes the ratio for CPU offload only
        on_gpu = twin_flow_gpu_sub_groups(len(subs), run.opts.offload_ratio)
    return subs[:on_gpu], subs[on_gpu:]


class DeepSpeedMemory(EngineMemory):

    cpu_process_bytes = CPU_DEEPSPEED_RSS_BYTES

    def states(self, s: StrategySpec, d: int, precision: str, optimizer: str = "adamw", in_backward: bool = False,
               master_weights: str = "fp32") -> States:
        """16-bit (fp32 runs: fp32) params and grads, fp32 master + AdamW m, v, sharded per stage. fp32 runs update the
        params themselves, except under ZeRO 1-3, which step a copy even then: stage_1_and_2.py clones the partition
        (single_partition_of_fp32_groups), and stage3.py's _create_fp32_partitions shares it only when the partition's
        torch.device equals the accelerator's device *name* (a str: never equal). gpt2 fp32 on the CPU: zero2 and zero3
        hold a 0.464 GiB master beside the 0.464 GiB params (benchmarks/results/*-cpu-host-model)."""
        F, stage = Fraction, s.zero_stage
        lo = F(2) if precision != "fp32" else F(4)
        opt = (F(4) if precision != "fp32" or stage >= 1 else F(0)) + F(8)
        if stage == 0:
            return States(lo, lo, opt, "nothing sharded")
        if s.offload_optimizer is None:
            return States(lo if stage < 3 else lo / d, lo if stage == 1 else lo / d, opt / d, f"ZeRO-{stage} on the GPUs")
        if s.offload_params is None:
            return States(lo, F(0), F(0), "optimizer states and gradient partitions on the CPU")
        if s.offload_params == "cpu":
            return States(F(0), F(0), F(0), "parameters, gradients and optimizer states on the CPU")
        return States(F(0), F(0), F(0), "parameters and optimizer states on NVMe")  # gradient partitions on the CPU

    def held(self, run: Run) -> Held:
        st, n = self.run_states(run), run.n
        h = Held(float(st.params * n), float(st.grads * n), float(st.optimizer * n), st.where, float(st.per_param))
        on_gpu: list[int] = []
        if run.spec.offload_params == "cpu":
            on_gpu, on_host = optimizer_split(run)
            if on_gpu:
                # Partial offload (Twin-Flow; stage3.py): a GPU sub-group keeps its fp32 master (_create_fp32_partitions
                # l.1157-1160), its fp32 gradient buffer (initialize_optimizer_states l.1337-1342; never freed under
                # offload: _release_sub_group l.2733-2734) and, from the first step, torch AdamW's m and v (the "backup"
                # optimizer that steps the GPU sub-groups, l.313-326 and l.1249-1258): 16 B per element.
                g = sum(on_gpu)
                h.grads += 4.0 * g
                h.optimizer += 12.0 * g
                h.states_per_param += 16.0 * g / n
                h.where = (f"Twin-Flow (offload ratio {run.opts.offload_ratio}): {len(on_gpu)} of {len(on_gpu) + len(on_host)} "
                           f"optimizer sub-groups ({g:,} elements: fp32 master, grads, AdamW m, v) on the GPU; the rest, "
                           "the 16-bit params and 16-bit grads on the CPU")
        if run.spec.zero_stage == 3:
            self._stage3(run, h, on_gpu)
        else:
            self._stages_0_to_2(run, h)
        # zero_grad(set_to_none=True) frees gradients between steps; accumulation, and Twin-Flow's buffers, keep them
        if run.accum > 1 or on_gpu:
            h.grads_in_backward = h.grads
        return h

    def _stages_0_to_2(self, run: Run, h: Held) -> None:
        s, n, d, lo, opts = run.spec, run.n, run.world, run.lo, run.opts
        if s.zero_stage == 0:
            h.step["fp32 gradient copy for the step (FP16_Optimizer)"] = 4.0 * n
            return
        buckets = sized_buckets(opts, n, run.arch.hidden, s.offload_optimizer, d, s.offload_params is not None)
        rb = buckets["reduce_bucket_size"]
        # On a CPU the bucket is host memory that becomes resident only as backward writes gradients into it, past the
        # activations' peak, and is freed at the end of backward (_release_ipg_buffers): gpt2 zero2 on one CPU rank
        # peaked at its states + activations in backward (benchmarks/results/*-cpu-host-model)
        if contiguous_gradients(opts, s.zero_stage, s.offloads) and run.device != "cpu":
            # On a GPU the bucket (two under overlap_comm) is allocated by the first gradient hook of backward
            # (process_gradients -> setup_buckets) and freed at backward's end (_release_ipg_buffers), so it never meets
            # the logits at the start of backward. llama-3.2-1b micro 8 on H200s: 26.58 GiB measured on 2 GPUs, 33.48 on
            # 1, planned 28.38 and 34.35 (two buckets, one) with it counted there.
            overlap = overlap_comm(opts, d, s.offload_optimizer)
            label = f"reduce bucket {rb:,} x {lo} B" + (" x2 (overlap_comm)" if overlap else "")
            h.from_first_grad[label] = float((2 if overlap else 1) * rb * lo)
        if s.offload_optimizer is not None:
            # ZeRO-Offload's GPU twin of the host staging buffer (stage_1_and_2.py __init__, temp_grad_buffer_for_gpu_offload):
            # the largest parameter in 16 bits, for the whole run. Missing, the plan validation grid had zero2_offload
            # 0.22-0.27 GiB low (gpt2 seq 512: -19.6%; benchmarks/results/*-h100-plan-validation)
            h.persistent["GPU gradient staging buffer (largest parameter)"] = float(lo * run.arch.largest_param)
            if gpu_grad_accum_fp32(run.cfg, s.name, run.precision, run.accum):
                # data_types.grad_accum_dtype=fp32 (shardlab's, or a user JSON's): the micro-batches' gradients summed on
                # the GPU, copied out once. A user JSON's bf16 keeps DeepSpeed's host accumulation: no GPU buffer
                # (bloom-3b m16 x 4: 49.32 GiB measured, planned 60.23 before this read the JSON)
                h.persistent["fp32 gradient accumulation partition (on the GPU)"] = 4.0 * n / d
        else:
            h.step["fp32 gradient partition for the step"] = 4.0 * n / d
            if run.device == "cpu" and run.cfg.optimizer == "adamw":
                # Without offload on a CPU DeepSpeed steps torch's AdamW (deepspeed_config.use_deepspeed_optimizer) over its
                # flat fp32 partition of each param group (gpt2 fp32, one rank: zero2's step peaked 3 x 0.464 GiB over its
                # states), one group at a time, freeing the group's 16-bit gradients once made fp32
                # (free_grad_in_param_list) before its step: only what the temporaries exceed them counts
                k = max(math.ceil(sum(g) / d) for g in ds_group_params(run.arch, run.cfg.weight_decay))
                h.step["AdamW temporaries over the flat fp32 partition (CPU), beyond the gradients freed before"] = max(
                    0.0, cpu_adamw_temp_bytes(k) - lo * k)
        if d > 1:
            h.notes.append(f"allgather_bucket_size {buckets['allgather_bucket_size']:,} is used in place "
                           "(all_gather_into_tensor), no extra buffer counted")

    def _stage3(self, run: Run, h: Held, on_gpu: list[int]) -> None:
        s, n, d, lo, opts = run.spec, run.n, run.world, run.lo, run.opts
        buckets = sized_buckets(opts, n, run.arch.hidden, s.offload_optimizer, d, s.offload_params is not None)
        rb = min(buckets["reduce_bucket_size"], n) if run.device == "cpu" else buckets["reduce_bucket_size"]  # written: resident
        contiguous = contiguous_gradients(opts, 3, s.offloads)
        if contiguous:
            h.persistent[f"ZeRO-3 reduce bucket {rb:,} x {lo} B"] = float(rb * lo)
        if not s.offloads:
            h.persistent["ZeRO-3 gradient partition flat buffer"] = float(lo * n / d)
            h.grads = 0.0  # the gradients are views of that buffer
            if not contiguous:
                self._reduce_without_contiguous(run, h, rb)
            h.step["fp32 gradient of the largest optimizer sub-group (step)"] = self._sub_group_step(run)
        label, gather = self._gathered(run, buckets)
        h.backward[label] = float(lo * gather)
        # An eval forward after training replays the training trace, so it keeps the same gathered params (their next use
        # is the backward that does not come): bloom-3b zero3_offload's final eval held the embedding and the last blocks'
        # weights, 1.87 GiB, on one GPU (16.30 GiB measured, no initial eval). shardlab clears DeepSpeed's lru_cache'd
        # release decisions when a new trace completes (compat/zero3_release_cache.py), so the final eval holds these
        # params with or without the initial eval (CPU: tests/test_zero3_release_cache.py).
        h.eval_gathered = float(lo * gather)
        h.persistent["ZeRO-3 persistent small params (whole on every GPU)"] = float(lo * run.arch.persistent_params * (1 - 1 / d))
        if on_gpu:
            # torch AdamW's foreach step (torch/optim/adam.py _multi_tensor_adam: every update in place but
            # exp_avg_sq_sqrt = _foreach_sqrt(v)), one GPU sub-group at a time (stage3.py step l.2909-2927)
            h.step["AdamW sqrt(v) of the largest GPU sub-group (Twin-Flow step)"] = 4.0 * max(on_gpu)

    @staticmethod
    def _reduce_without_contiguous(run: Run, h: Held, rb: int) -> None:
        """Without contiguous gradients (one-rank ZeRO-3's default) the reduce bucket is a list of the parameters' own
        gradients, reduced once it holds reduce_bucket_size elements (at the end of backward when that is the whole
        model), and DeepSpeed's reduce_scatter_coalesced first flattens them into one more copy (torch.cat). gpt2 fp32,
        micro 1 x 256, one H200: 3.31 GiB measured, 2.81 planned without this, the 148 gradients and a 0.46 GiB flat copy
        alive at the peak (benchmarks/results/*-cpu-host-model/gpu-call1/z3-fp32-peak-snapshot.txt). One-rank ZeRO-3's
        identity_reduce_scatter (compat/zero3_one_rank.py) makes no copy: the gradients only."""
        s, lo = run.spec, run.lo
        flat_copy = "identity_reduce_scatter" not in one_rank_shortcuts(run.opts, 3, run.world, s.offloads)
        held = float(lo * min(rb, run.n))
        what = "the gradients it holds" + (" and their flat copy" if flat_copy else "")
        h.after_backward.append(((2.0 if flat_copy else 1.0) * held, f"end of backward (ZeRO-3's reduce: {what})"))
        parts = run.arch.pipeline_parts or {}
        if parts.get("tied"):  # the embedding's gradient, added into the tied head's (ddp.py says when)
            h.after_backward.append((held + lo * parts["vocab_x_hidden"], TIED))

    @staticmethod
    def _sub_group_step(run: Run) -> float:
        """The step, one sub-group at a time (stage3.py _prepare_fp32_grad_for_sub_group): the sub-group's gradients
        flattened and made fp32 (a 16-bit flat copy, then its fp32 one; fp32's .to is the same tensor), freed after that
        sub-group's step; on a CPU torch's AdamW then steps the flat fp32 master."""
        k = max(optimizer_split(run)[1])
        step = 4.0 * k + (run.lo * k if run.mixed else 0.0)
        if run.device == "cpu" and run.cfg.optimizer == "adamw":
            step = max(step, 4.0 * k + cpu_adamw_temp_bytes(k))
        return step

    @staticmethod
    def _gathered(run: Run, buckets: dict[str, int]) -> tuple[str, int]:
        """(what, elements) of the parameters ZeRO-3 holds gathered at the start of backward."""
        s, n, opts = run.spec, run.n, run.opts
        # A leaf module (a whole decoder block) is fetched as one unit, so the largest unit gathered at once is a block.
        leaf = run.arch.block_params if run.arch.leaf_classes and block_leaves(opts, 3, s.offloads) else 0
        unit = max(run.arch.largest_layer_params, leaf)
        gather = min(opts.stage3_max_live_parameters, unit + buckets["stage3_prefetch_bucket_size"])
        if run.device == "cpu":
            gather = min(gather, n)
        label = "ZeRO-3 gathered params (largest layer or leaf block + prefetch bucket)"
        if run.world > 1 or s.offload_params is not None:
            # Gathered copies are allocations of their own here (one GPU without parameter offload showed no such extra).
            # DeepSpeed keeps a gathered parameter whose next use lies within stage3_max_reuse_distance parameters of the
            # module trace (partitioned_param_coordinator.__params_to_release); after forward the next uses are
            # backward's, so up to that many stay gathered at the start of backward. gpt2-large zero3_offload -16.4% and
            # zero3 on 2/4 GPUs -6.6%/-7.5% with the largest-layer allowance alone, -1.0% and -0.7%/-0.6% with this
            # (benchmarks/results/*-h100-session3/).
            kept = min(n, opts.stage3_max_reuse_distance + buckets["stage3_prefetch_bucket_size"])
            if kept > gather:
                gather, label = kept, "ZeRO-3 gathered params kept for reuse in backward (stage3_max_reuse_distance)"
        if buckets["stage3_param_persistence_threshold"] >= n:  # one rank: every parameter persists, none is gathered
            return "ZeRO-3 gathered params (none: every parameter persists on one rank)", 0
        return label, gather

    def host(self, run: Run) -> dict[str, float]:
        s = run.spec
        if s.offload_optimizer == "cpu" and s.offload_params is None:
            out = self._offload_host(run)
        elif s.offload_params is not None:
            out = self._param_offload_host(run)
        else:
            out = {}
        if s.offload_params == "nvme":
            out["AIO pinned param swap buffers (approx.)"] = float(INFINITY_PARAM_BUFFERS)
        return out

    @staticmethod
    def _offload_host(run: Run) -> dict[str, float]:
        """ZeRO-Offload (stage_1_and_2.py): the flat fp32 partitions (pinned with pin_memory), CPU Adam's m and v."""
        pin, lo, d = run.opts.pin_memory and run.device == "cuda", run.lo, run.world
        parts = [math.ceil(sum(g) / d) for g in ds_group_params(run.arch, run.cfg.weight_decay)]
        out = {"fp32 master partition (one flat buffer per param group)": sum(pinned_bytes(4 * k, pin) for k in parts),
               "fp32 gradient partition": sum(pinned_bytes(4 * k, pin) for k in parts),
               "16-bit copy-back buffer of the partition": sum(pinned_bytes(lo * k, pin) for k in parts),
               "AdamW m, v (CPU Adam)": 8.0 * sum(parts),
               "gradient staging buffer (largest parameter)": pinned_bytes(lo * run.arch.largest_param, pin)}
        # accumulated_grads_in_cpu: one buffer per parameter of the partition, kept between steps (unless the sum is
        # kept on the GPU in fp32: gpu_grad_accum_fp32, which also reads a user JSON's data_types)
        if run.accum > 1 and not gpu_grad_accum_fp32(run.cfg, run.spec.name, run.precision, run.accum):
            out["gradient accumulation buffers (per parameter)"] = sum(pinned_bytes(lo * k, pin) for k, _ in run.arch.param_sizes) / d
        return out

    @staticmethod
    def _param_offload_host(run: Run) -> dict[str, float]:
        """ZeRO-3 with parameter offload (stage3.py). The sub-groups kept on the GPU by partial offload hold their fp32
        master, gradient and AdamW m, v there (``held``); only the host's have the three below. Unchanged by the ratio:
        the 16-bit gradient flat buffer (all of the partition's gradients land there first, l.791-795 and partition_grads
        l.2022-2025) and the 16-bit params (offload_param: the GPU sub-groups' updates are copied back, l.2854-2860)."""
        pin, lo, d = run.opts.pin_memory and run.device == "cuda", run.lo, run.world
        on_gpu, subs = optimizer_split(run)
        # initialize_optimizer_states l.1337-1342: one gradient buffer per sub-group, made on the host (pinned with
        # pin_memory) and moved to the sub-group's device
        out = {"fp32 gradient buffer per sub-group": sum(pinned_bytes(4 * k, pin) for k in subs)}
        if pin and on_gpu:
            # ... so a GPU sub-group's pinned buffer is freed once copied, and torch's pinned allocator keeps the block
            # cached; a later (host) sub-group's buffer of the same power-of-two size reuses it, other sizes do not.
            if cached := {pinned_bytes(4 * k, True) for k in on_gpu} - {pinned_bytes(4 * k, True) for k in subs}:
                out["pinned gradient staging of GPU sub-groups, kept cached"] = float(sum(cached))
        out["16-bit gradient partition flat buffer"] = pinned_bytes(lo * math.ceil(run.n / d), pin)
        if run.spec.offload_params == "cpu":
            # _create_fp32_partitions l.1157-1160: the host sub-groups' fp32 master is a clone, never pinned; CPU Adam's
            # m and v exist for the host sub-groups only (the GPU ones step in torch AdamW, l.1249-1258)
            out["fp32 master partition"] = 4.0 * sum(subs)
            out["AdamW m, v (CPU Adam)"] = 8.0 * sum(subs)
            if on_gpu and lo == 2:
                # the step's copy of a GPU sub-group's fp32 master into the host 16-bit params (l.2858-2859) is a blocking
                # GPU->CPU copy with a dtype change: torch converts on the CPU, through an fp32 host temporary of the
                # sub-group (aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda), one at a time
                out["fp32 host staging of a GPU sub-group's update (optimizer step)"] = 4.0 * max(on_gpu)
            # param_groups_fp16_flat_cpu_memory is pinned whatever pin_memory says (on a GPU)
            groups = ds_group_params(run.arch, run.cfg.weight_decay)
            out["16-bit param partition (flat, always pinned)"] = sum(
                pinned_bytes(lo * math.ceil(sum(g) / d), run.device == "cuda") for g in groups)
        return out

    def build(self, run: Run) -> tuple[str, float]:
        """ZeRO-3 builds inside zero.Init (a partition per rank); stages 0-2 on meta, drawn on the GPU, or in the
        engine's dtype on the CPU."""
        n, lo = run.n, run.lo
        if run.spec.zero_stage == 3 and run.device == "cuda":
            # A GPU rank's host peak while zero.Init builds: its 16-bit partition, and no gathered largest layer (that is
            # gathered on the GPU): 1 H200, qwen2.5-0.5b, bloom-1b7, llama-2-7b; 2 H200s, llama-3.2-1b, bloom-7b1
            # (benchmarks/results/*-h200-zero3-host-sizes)
            return ("model built inside zero.Init: the rank's 16-bit partition (load time)", float(lo * n / run.world))
        if run.spec.zero_stage == 3:
            return ("model built inside zero.Init: one partition + the largest layer (load time)",
                    float(lo * (n / run.world + run.arch.largest_layer_params)))
        return built_on_meta(run) or (f"model built in {'fp32' if lo == 4 else '16-bit'} on the CPU (load time)", float(lo * n))

    def nvme(self, run: Run) -> float:
        return float(NVME_BYTES_PER_PARAM * run.n / run.nodes) if run.spec.offload_params == "nvme" else 0.0

    def paper_bytes_per_param(self, s: StrategySpec, d: int) -> Fraction | None:
        """baseline 16, P_os 4 + 12/N, P_os+g 2 + 14/N, P_os+g+p 16/N; the paper's figure has no offload."""
        if s.offloads:
            return None
        return {0: Fraction(16), 1: Fraction(4) + Fraction(12, d), 2: Fraction(2) + Fraction(14, d), 3: Fraction(16, d)}[s.zero_stage]

    def estimate(self, run: Run) -> dict[str, int] | None:
        """DeepSpeed's own model-state estimators (deepspeed 0.19.8), as they compute them:
        ``stage_1_and_2.estimate_zero2_model_states_mem_needs`` and ``stage3.estimate_zero3_model_states_mem_needs``
        (the ``*_all_cold`` variants print exactly these, additional_buffer_factor 1.5), for stage 2 and stage 3 and
        their CPU offload; ZeRO-Infinity has no NVMe variant, so its CPU offload's figures stand in. Bytes per GPU / per
        node. A transcription rather than an import of deepspeed: the import takes seconds, logs on every machine
        without a GPU, and binds DeepSpeed's logger to whatever stdout is current (tests/test_plan.py checks it)."""
        s, arch = run.spec, run.arch
        if s.zero_stage == 2 and s.offload_params is None:
            cpu, gpu = ds_zero2_formula(arch.n_params, run.gpus_per_node, run.nodes, cpu_offload=s.offload_optimizer is not None)
        elif s.zero_stage == 3:
            off = s.offload_params is not None
            cpu, gpu, _ = ds_zero3_formula(arch.n_params, arch.largest_layer_params, run.gpus_per_node, run.nodes,
                                           cpu_offload=off, cpu_offload_params=off, zero_init=True)
        else:
            return None
        return {"gpu": gpu, "cpu": cpu}


def ds_zero2_formula(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3_formula(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                     cpu_offload_params=True, zero_init=True, additional_buffer_factor=1.5):
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest
            cpu_mem = total_params * (18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor)) * additional_buffer_factor
        else:
            gpu_mem = largest + int(2 * total_params / total_gpus)
            cpu_mem = total_params * (16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor)) * additional_buffer_factor
    else:
        gpu_mem = largest + int(18 * total_params / total_gpus)
        cpu_mem = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest
