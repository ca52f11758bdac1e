"""The DeepSpeed JSON shardlab generates for a run of `zero0`..`zero3`, `*_offload` or `infinity`.

Generated from the RunConfig, so the batch triple, precision, clipping and optimizer hyper-parameters always agree with
the run; a user's own JSON is merged on top (deepspeed_json.py). The planner reads the same choices (bucket sizes,
leaves, contiguous gradients, the one-rank shortcuts) to count what the engine will hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import compat
from ..compat import zero3_one_rank
from ..config import RunConfig
from ..errors import UserError
from ..specs.registry import all_specs, spec
from .deepspeed_json import merge_user_config, read_user_json

if TYPE_CHECKING:  # annotations only: the JSON is written without torch
    from torch import nn

# Lazy imports below: training.models (transformers) and deepspeed load only when the leaf classes are looked up.

# Derived from the specs (specs/deepspeed_zero.py owns each name's stage).
STAGE = {s.name: s.zero_stage for s in all_specs() if s.engine == "deepspeed"}


def offload_kind(strategy: str) -> str | None:
    """Where `strategy` keeps its optimizer states instead of the GPU: "cpu", "nvme" or None."""
    return spec(strategy).offload_optimizer


# DeepSpeed 0.19.8's own defaults (runtime/zero/config.py) for the options a user leaves unset (None in StrategyOptions).
DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                      "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000}


def sized_buckets(opts, n_params: int | None, hidden: int | None, offload: str | None, world: int = 0,
                  params_offloaded: bool = False) -> dict[str, int]:
    """Bucket sizes (elements) for this model, where the user left them unset (None).

    With CPU offload every gradient bucket is also the unit of the device->host copy and every ZeRO-3
    prefetch bucket a host->device copy: DeepSpeed's 5e8-element defaults are tuned for NVLink all-reduce
    and, on one GPU, hold GBs of staging buffers (overlap_comm keeps ~4.5 reduce buckets alive) while
    the copies start only when a whole bucket is full. The rule HF Trainer's "auto" uses, hidden^2 for the
    reduce bucket and 0.9 hidden^2 for the ZeRO-3 prefetch (one layer's largest matrix: a copy starts
    as soon as a layer's gradients are ready), and 10 x hidden as the persistence threshold (norms and
    biases stay resident), keeps the staging small and the copies overlapped with backward.
    `sub_group_size` (ZeRO-3: the unit of the optimizer step and of Twin-Flow's GPU/CPU split) is a tenth
    of the model, between 1e8 and DeepSpeed's 1e9: ten groups let the partial offload's ratio land within
    10% and one group's CPU step overlap the next group's copies, and 1e8 keeps the per-group overhead small.
    The ZeRO-3 prefetch bucket and persistence threshold are at least DeepSpeed's (measured below).

    ZeRO-3 on one rank (`world` 1) with its parameters on the GPU: a rank's partition of a parameter is the whole
    parameter, so gathering it only copies it into a second buffer in every forward and backward and frees it after.
    Persisting every parameter (threshold = the model's size) keeps one copy where the gather kept two, and skips
    the copies and the coordinator's fetch/release work (without them zero3 ran at 0.41x dp on one GPU).
    """
    unset = {k for k in DEEPSPEED_DEFAULTS if getattr(opts, k) is None}
    out = {k: DEEPSPEED_DEFAULTS[k] if k in unset else getattr(opts, k) for k in DEEPSPEED_DEFAULTS}
    out["sub_group_size"] = 1_000_000_000
    if world == 1 and not params_offloaded and n_params and "stage3_param_persistence_threshold" in unset:
        out["stage3_param_persistence_threshold"] = int(n_params)
    if offload is None or not hidden:
        return out
    sized = {"reduce_bucket_size": hidden * hidden, "allgather_bucket_size": hidden * hidden,
             "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden), "stage3_param_persistence_threshold": 10 * hidden}
    # The ZeRO-3 prefetch bucket and persistence threshold are at least DeepSpeed's: a prefetch bucket below one layer
    # (bloom-1b7's 3.8 M elements against ~50 M a layer) leaves the parameter fetches unoverlapped. Two-GPU zero3_offload:
    # 16.9 k tok/s (one run) against 14.4-15.3 k sized, GPU peak 10.70 GiB against 10.72 (2 x H200,
    # benchmarks/results/*-h200x2-offload-buckets); one GPU: 7.36 k median of 3 against 7.00 k, every round
    # faster, the same 10.70 GiB peak (H200, benchmarks/results/*-h200-one-gpu-offload-prefetch). The memory
    # saving is the reduce bucket's, which stays sized.
    for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        sized[k] = max(sized[k], DEEPSPEED_DEFAULTS[k])
    out.update({k: v for k, v in sized.items() if k in unset})
    if n_params:
        out["sub_group_size"] = int(min(1e9, max(1e8, n_params / 10)))
    return out


def one_rank_zero3(stage: int, world: int, offloads: bool) -> bool:
    """ZeRO-3 on one rank with everything on the GPU: nothing is reduce-scattered or gathered (every parameter persists,
    sized_buckets), so what stage 3 adds over dp is host work per module and per parameter."""
    return stage == 3 and world == 1 and not offloads


def contiguous_gradients(opts, stage: int, offloads: bool) -> bool:
    """DeepSpeed's contiguous_gradients, where the user left it unset: off for ZeRO-3 without offload, on otherwise
    (DeepSpeed's default). ZeRO-3 copies every gradient, parameter by parameter in each leaf's backward hook, into the
    bucket; on one rank nothing reduces it (and the bucket, reduce_bucket_size x 2 B, is 0.93 GiB of GPU memory:
    gpt2-medium 17.91 GiB measured without it, 18.7 with; benchmarks/results/*-h100-zero3-{blocks,combo,gc,pin}/), and
    on several ranks reduce_scatter_coalesced flattens the bucket's gradients into its own buffer again. Without it,
    two-rank ZeRO-3's code path on one H200 ran 8% faster a step (llama-3.2-1b; *-h200-zero3-two-rank-path/). With
    offload the bucket is what is copied to the host: kept."""
    if opts.contiguous_gradients is not None:
        return opts.contiguous_gradients
    return not (stage == 3 and not offloads)


def block_leaves(opts, stage: int, offloads: bool, adapted: bool = False) -> bool:
    """Whether ZeRO-3 hooks each decoder block as one leaf module (zero3_leaf_classes). Unset: on without offload. On one
    rank nothing is gathered, so a leaf only saves hook calls; on several ranks DeepSpeed's coordinator runs per
    sub-module otherwise (fetch, trace, release and prefetch bookkeeping ~10x per block in forward and again in
    backward), which left the GPU idle most of the step: gpt2-large on 2 x H200, 35.5k -> 50.8k tok/s on one host,
    the gathered memory unchanged (30.40 -> 30.33 GiB), since a block (20M parameters) is below the prefetch bucket."""
    if stage != 3:
        return False
    if adapted:  # --peft: with block leaves DeepSpeed 0.19.8 left an adapter partitioned in the second step's backward
        return False
    return opts.zero3_block_leaves if opts.zero3_block_leaves is not None else not offloads


def one_rank_shortcuts(opts, stage: int, world: int, offloads: bool) -> tuple[str, ...]:
    """The one-rank ZeRO-3 shortcuts a run takes (compat/zero3_one_rank.py): all of them where the user left
    strategy_options.zero3_one_rank_shortcuts unset, the ones named otherwise, less those this DeepSpeed may not take
    (compat.enabled); none but on one rank without offload. The planner reads it too: identity_reduce_scatter removes
    the flat copy of every gradient at the end of backward."""
    if not one_rank_zero3(stage, world, offloads):
        return ()
    wanted = opts.zero3_one_rank_shortcuts
    return tuple(n for n in (zero3_one_rank.SHORTCUTS if wanted is None else wanted) if compat.enabled(n))


def zero3_leaf_classes(model: nn.Module | None) -> list[str]:
    """The class name of the model's repeated decoder block (GPT2Block, BloomBlock, LlamaDecoderLayer), for DeepSpeed's
    `leaf_module.classes`: ZeRO-3 then hooks each block as one module, not its ~9 sub-modules (ln, attention, c_attn,
    ...), about 9x fewer coordinator calls a step. On one rank every parameter persists, so a leaf gathers nothing and
    bounds no memory. A block-class leaf is the model-size rule the issue asks for: DeepSpeed's alternative,
    stage3_module_granularity_threshold, compares parameters per module with a number that separates gpt2-medium's
    blocks (1.40M) from its whole model (1.61M) by 15%."""
    if model is None:
        return []
    from ..training.models import transformer_blocks

    blocks = transformer_blocks(model)
    names = sorted({type(b).__name__ for b in blocks})
    return names if len(names) == 1 else []


def _deepspeed_default_leaves() -> list[str]:
    """DeepSpeed's own default leaf classes (MoE blocks): a `classes` list replaces them, so it repeats them."""
    try:
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
    except ImportError:
        return []
    return list(DEFAULT_LEAF_MODULE_CLASSES)


def compile_problem(cfg: RunConfig, device_type: str) -> UserError | None:
    """Why a ZeRO-3 ``--compile`` run of ``cfg`` is refused, or None: a DeepSpeed JSON that turns the memory-efficient
    linear back on (build_ds_config turns it off under --compile; see plain_linear_under_compile)."""
    if STAGE.get(cfg.strategy) != 3 or not cfg.compile or not cfg.deepspeed_config:
        return None
    if (read_user_json(cfg.deepspeed_config).get("zero_optimization") or {}).get("memory_efficient_linear") is True:
        return UserError("zero_optimization.memory_efficient_linear true with zero3 --compile: compiled linears with a bias "
                         "then got no weight or bias gradients (torch 2.11)",
                         "drop memory_efficient_linear from the DeepSpeed JSON (shardlab turns it off under --compile), "
                         "or drop --compile")
    return None


def plain_linear_under_compile(stage: int, compile: bool) -> dict[str, Any]:
    """The zero_optimization keys that keep compiled ZeRO-3 gradients right. DeepSpeed's memory-efficient linear (on by
    default) swaps ``F.linear`` for its own autograd Function; compiled by torch 2.11 (the GPU image's; 2.13 computes
    them right), a linear with a bias got zero weight and bias gradients through it (BLOOM's gradient norm fell to a
    quarter of eager's, Qwen2's to 57%), while torch's own linear under compile gave eager's losses, at llama's speed
    with DeepSpeed's linear (benchmarks/results/*-h200-zero3-compile-linear)."""
    return {"memory_efficient_linear": False} if stage == 3 and compile else {}


def overlap_comm(opts, world: int, offload: str | None) -> bool:
    """Overlapping reduction with backward pays off only when there is communication to hide: other ranks,
    or (offload) the device->host gradient copies, which otherwise run after backward, serialised. On one
    GPU without offload it only adds stream synchronisation (DeepSpeed's own default is off)."""
    return opts.overlap_comm if opts.overlap_comm is not None else (world > 1 or offload is not None)


def bf16_overflow_check(cfg: RunConfig, stage: int, offload: str | None) -> bool:
    """Whether a bf16 ZeRO-1/2 engine checks every gradient for inf/NaN before its step (DeepSpeed's
    ``bf16.check_grad_overflow``, on by default), or leaves that to the gradient norm it computes anyway.

    DeepSpeed 0.19.8's check (stage_1_and_2.py ``has_overflow_partitioned_grads_serial``) runs ``has_inf_or_nan`` on
    each parameter's gradient, about ten small operators each (amax, amin, isfinite, ...: some 3,000 launches a step
    for gpt2-medium's 292 tensors), and then waits for the GPU with an ``.item()`` before the optimizer step. On one
    H100 that host work was most of the time zero1/zero2 lost to dp: gpt2-medium micro 8 runs at 1.31x / 1.13x dp
    eager without it, 0.76x / 0.81x with it, same call (benchmarks/results/*-h100-zero-speed).

    The check is only needed where DeepSpeed itself must skip the update: nan_policy "skip". Under "stop" (the
    default) the engine still computes the global norm (``compute_grad_norm``), which is +inf when any gradient is
    non-finite (utils.combine_grad_norm_groups), and the trainer stops at that same step on it, before any checkpoint
    (trainer._guard_nonfinite): the only difference is that the discarded in-memory weights took the update.
    fp16 always checks (DeepSpeed forces it: loss scaling needs it); CPU offload and ZeRO-3 keep DeepSpeed's default
    (not measured; stage 3 does not read the setting). A user JSON's ``bf16.check_grad_overflow`` wins."""
    return cfg.nan_policy == "skip" or offload is not None or stage not in (1, 2)


def offload_grad_accum_fp32(stage: int, offload: str | None, accum: int, precision: str) -> bool:
    """Whether shardlab asks a bf16 ZeRO-2 run with CPU optimizer offload to accumulate its gradients in an fp32 buffer
    on the GPU (``data_types.grad_accum_dtype = fp32``; a user's JSON can still say otherwise: ``gpu_grad_accum_fp32``).

    DeepSpeed 0.19.8 (zero/stage_1_and_2.py) accumulates an offload run's bf16 gradients on the *host*: after every
    micro-batch but the last, each parameter's gradient makes a round trip (the running sum copied host->device, added,
    copied back: async_accumulate_grad_in_cpu_via_gpu), 4 bytes a parameter over PCIe per micro-batch. bloom-3b at
    micro 4 x accum 16 spent 11.6 s of a 12.7 s step there and in compute (benchmarks/results/*-h100-big-model).
    With ``data_types.grad_accum_dtype = fp32`` the engine keeps one flat fp32 gradient partition on the GPU
    (_use_compact_grad_partition_buffer), sums every micro-batch into it and copies it to the host once, at the
    accumulation boundary: 4 B/param more GPU memory (planner: "fp32 gradient accumulation buffer"), no per-micro-batch
    transfers, and the sum is fp32 instead of bf16. One micro-batch per step takes DeepSpeed's direct copy anyway.
    Only bf16 was measured (fp16 and fp32 runs get DeepSpeed's default); stage 1 shares the code but was not measured;
    ZeRO-3 offload accumulates in its own fp32 host buffers."""
    return precision == "bf16" and stage == 2 and offload == "cpu" and accum > 1


def grad_accum_dtype(cfg: RunConfig, strategy: str, precision: str, accum: int) -> str | None:
    """``data_types.grad_accum_dtype`` as the engine of ``strategy`` gets it: a user's ``--deepspeed-config`` sets it
    on top of the generated JSON (merge_user_config), else shardlab's choice (``offload_grad_accum_fp32``); None:
    DeepSpeed's default, the parameters' dtype."""
    if cfg.deepspeed_config:
        user = (read_user_json(cfg.deepspeed_config).get("data_types") or {}).get("grad_accum_dtype")
        if user is not None:
            return user
    s = spec(strategy)
    return "fp32" if offload_grad_accum_fp32(s.zero_stage, s.offload_optimizer, accum, precision) else None


def gpu_grad_accum_fp32(cfg: RunConfig, strategy: str, precision: str, accum: int) -> bool:
    """Whether a ZeRO-1/2 CPU-offload run keeps DeepSpeed's compact fp32 gradient partition on the GPU between its
    micro-batches (4 B/param; see ``offload_grad_accum_fp32``), or sends each micro-batch's gradients to the host (no
    GPU buffer; per-parameter accumulation buffers on the host). DeepSpeed takes the compact buffer wherever
    grad_accum_dtype is fp32 and the parameters are 16-bit, whoever set it: a user JSON with ``bf16`` keeps the old
    host accumulation (bloom-3b m16 x 4: 49.32 GiB of GPU measured, against 60.51 with the buffer)."""
    s = spec(strategy)
    if s.engine != "deepspeed" or s.zero_stage not in (1, 2) or s.offload_optimizer != "cpu" or s.offload_params is not None:
        return False
    return precision != "fp32" and accum > 1 and grad_accum_dtype(cfg, strategy, precision, accum) == "fp32"


def build_ds_config(
    cfg: RunConfig, precision: str, micro: int, accum: int, world: int, device_type: str,
    n_params: int | None = None, hidden: int | None = None, leaf_classes: list[str] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed JSON for this run (before any user JSON is merged). `n_params` and `hidden` (the
    model's size and width) size the buckets of offload runs (sized_buckets); `leaf_classes` (zero3_leaf_classes: the
    model's decoder-block class) become ZeRO-3 leaves on one rank without offload."""
    stage = STAGE[cfg.strategy]
    opts = cfg.strategy_options
    offload = offload_kind(cfg.strategy)
    buckets = sized_buckets(opts, n_params, hidden, offload, world, spec(cfg.strategy).offload_params is not None)
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": overlap_comm(opts, world, offload),
        "contiguous_gradients": contiguous_gradients(opts, stage, spec(cfg.strategy).offloads),
        "reduce_bucket_size": buckets["reduce_bucket_size"],
        "allgather_bucket_size": buckets["allgather_bucket_size"],
    }
    if stage == 3:
        zero.update(
            sub_group_size=buckets["sub_group_size"],
            stage3_prefetch_bucket_size=buckets["stage3_prefetch_bucket_size"],
            stage3_param_persistence_threshold=buckets["stage3_param_persistence_threshold"],
            stage3_max_live_parameters=opts.stage3_max_live_parameters,
            stage3_max_reuse_distance=opts.stage3_max_reuse_distance,
            # Export gathers weights itself (full_state_dict); no 16-bit copy needed at save time.
            stage3_gather_16bit_weights_on_model_save=False,
            **plain_linear_under_compile(stage, cfg.compile),
        )
        if leaf_classes and block_leaves(opts, stage, spec(cfg.strategy).offloads, cfg.peft.method is not None):
            zero["leaf_module"] = {"classes": _deepspeed_default_leaves() + list(leaf_classes)}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": opts.pin_memory}
        if opts.offload_ratio < 1.0:  # Twin-Flow: the rest of the optimizer states stay and step on the GPU
            zero["offload_optimizer"]["ratio"] = opts.offload_ratio
        if opts.zenflow:  # DeepSpeed's defaults (top 10% columns, auto intervals); not bit-exact AdamW
            zero["zenflow"] = {"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto", "update_interval": "auto",
                               "overlap_step": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": opts.pin_memory}
    elif offload == "nvme":
        nvme = str(Path(opts.nvme_path or "").resolve())
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": opts.pin_memory}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": opts.pin_memory}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world,
        "gradient_clipping": cfg.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # shardlab logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if offload_grad_accum_fp32(stage, offload, accum, precision):
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
        if not bf16_overflow_check(cfg, stage, offload):
            ds["bf16"]["check_grad_overflow"] = False
    elif precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if use_deepspeed_optimizer(cfg, device_type):
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": [cfg.adam_beta1, cfg.adam_beta2],
                "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay,
            },
        }
    else:
        ds["zero_allow_untested_optimizer"] = True
    return ds


def use_deepspeed_optimizer(cfg: RunConfig, device_type: str) -> bool:
    """DeepSpeed's own AdamW (FusedAdam on GPU, CPU-Adam when offloading) where it has a kernel;
    on a CPU-only machine without offload, torch's AdamW, which needs no JIT-compiled op."""
    return device_type == "cuda" or offload_kind(cfg.strategy) is not None


def resolved_ds_config(cfg: RunConfig, precision: str, micro: int, accum: int, world: int, device_type: str,
                       total_steps: int | None = None, n_params: int | None = None,
                       hidden: int | None = None, leaf_classes: list[str] | None = None) -> dict[str, Any]:
    """The JSON DeepSpeed will get: generated, then the user's file (if any) merged on top. `total_steps` fills a
    scheduler's total_num_steps "auto" (known once the data is built); `n_params`/`hidden` size the buckets."""
    ds = build_ds_config(cfg, precision, micro, accum, world, device_type, n_params, hidden, leaf_classes)
    if cfg.deepspeed_config:
        ds = merge_user_config(ds, cfg.deepspeed_config, precision, cfg, total_steps, device_type)
    return ds
