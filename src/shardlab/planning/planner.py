"""`shardlab plan`: predict per-GPU, CPU and NVMe memory of every strategy before a run.

What is predicted
-----------------
The **peak of ``torch.cuda.max_memory_allocated()``** per GPU (what ``shardlab train`` and
``benchmarks/results/`` report as ``gpu_mem_peak_gib``). Memory that the caching allocator
reserves but has not handed out (fragmentation) and the CUDA context (~0.5 GiB per process,
never in torch's counters) are *not* in that number; they are added only when deciding
whether a run fits (``CUDA_CONTEXT_BYTES`` and ``RESERVED_OVER_ALLOCATED``, in memory.py); a host prediction fits
with ``HOST_HEADROOM`` (3%) to spare.

How
---
* Parameter counts come from the model built on the meta device (no weights): total unique
  parameters, DeepSpeed's "largest layer" (largest parameter count held directly by one module,
  as ``estimate_zero3_model_states_mem_needs_all_live`` computes it), the largest transformer
  block (one FSDP unit) and the parameters outside the blocks (FSDP's root unit).
* Model states follow the mixed-precision recipe each engine *actually* uses in shardlab
  (see ``_model_states``): dp = torch autocast over fp32 weights (4 + 4 + 8 B/param); DeepSpeed
  bf16/fp16 = 16-bit params (2) + 16-bit grads (2) + fp32 master, m, v (12), sharded per stage;
  fp32 runs 4 + 4 + 8; FSDP2 with ``MixedPrecisionPolicy`` = fp32 sharded params, grads and
  AdamW states plus 16-bit unsharded copies of the units being computed (all of them with
  fsdp_reshard_after_forward=false, the default on one rank without offload) and, while accumulating,
  the whole model's unsharded fp32 gradients.
* Activations are counted per architecture family from the HF config, tensor by tensor, as
  autograd saves them in the transformers 5 implementations (memory.py, ``_layer_bytes``). The starting
  point is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198), eq. (1): 34·s·b·h + 5·a·s²·b bytes per layer in 16-bit. The counts
  here differ where the implementation differs: fused SDPA/flash kernels keep no s² tensors
  (only a fp32 log-sum-exp per row), GPT-2's ``gelu_new`` is a Python composite that saves four
  4h-wide tensors instead of one, RMSNorm saves a fp32 copy, torch autocast keeps the residual
  stream and LayerNorm in fp32, and CUDA dropout masks are 1-byte bools. The per-family counts
  were checked on CPU against the exact saved-tensor bytes (``tests/test_plan.py``).
  Under ``--compile`` the layers are counted as inductor's partitioner saves them (``memory._compiled_layer_bytes``,
  counted from compiled stacks on the CPU: ``benchmarks/compiled_activations.py``).
* The loss: transformers' ``ForCausalLMLoss`` (``loss_kernel=hf``, and on CPUs) upcasts the logits
  to fp32 and calls ``cross_entropy``; log-softmax saves its fp32 output (4·b·s·V B) and its backward
  holds that, the incoming gradient and the outgoing gradient at once: 12·b·s·V bytes at the start of
  backward. shardlab's compiled loss (``shardlab.training.loss``, the default on CUDA) keeps only the 16-bit
  logits and then their 16-bit gradient: 2·2·b·s·V (fp32 runs: 2·4·b·s·V).
* The peak is the largest of these moments: the start of backward (all saved activations + the loss'
  logits peak above + communication buckets + gathered parameters; gradients that ``zero_grad
  (set_to_none=True)`` freed are not there yet unless gradients are accumulated; with checkpointing
  no layer is recomputed yet), the LM head's backward, a checkpointed layer's backward (its
  recomputation and backward temporaries, the logits freed), the end of backward / optimizer step
  (all gradients, step temporaries, no activations) and an eval forward (shardlab evaluates before
  the first step, at epoch ends and after the last: the logits at the eval batch each rank gets,
  ``eval_batch_per_rank``, and one chunk of the eager loss' fp32 copies, ``eval_loss_bytes``); with 8-bit AdamW on a
  GPU, also the compile of its step before training, beside the weights alone (``eight_bit_warmup_bytes``).

Nothing here is fitted to measurements except the allowances named above (memory.py) and the 8-bit step's compiled
temporaries (``eight_bit_warmup_bytes``), whose sources are given. tests/test_plan.py::test_h100_foundation_errors documents the current error against
the H100 runs in ``benchmarks/results/`` (their figures: tests/data/h100_foundation_peaks.json).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Callable

import torch

from ..config import RunConfig
from ..errors import UserError
from ..layout import data_parallel_size, model_family
from ..training.head_padding import padded_vocab, pads
from ..training.loss import eval_chunk_tokens, resolve_loss_kernel
from ..strategies.spec import all_specs, find, names, spec, speed_order
from ..strategies.specs.deepspeed_zero import NVME_BYTES_PER_PARAM
from .memory import (
    CUDA_CONTEXT_BYTES,
    HOST_HEADROOM,
    PROCESS_RSS_BYTES,
    RESERVED_OVER_ALLOCATED,
    Activations,
    Arch,
    GiB,
    StrategyPlan,
    activation_bytes,
    compiled_layers_modelled,
    cpu_adamw_temp_bytes,
    host_fits,
    layer_backward_bytes,
)
from .microbatch import CPU_MAX_MICRO, MAX_MICRO, check_auto_batch, largest_that_fits, micro_candidates, with_micro_batch
from .pipeline import PipelineNotApplicable, pipeline_strategy_plan
from .host import GPU_PROCESS_RSS_BYTES, cpu_run_bytes, ds_group_params, host_build, host_states, launcher_bytes, zero3_optimizer_split
from ..strategies.deepspeed_zero import (block_leaves, contiguous_gradients, gpu_grad_accum_fp32, one_rank_shortcuts, overlap_comm, sized_buckets,
                                         zero3_leaf_classes)
from ..training.optim import arithmetic, resolve_precision
from ..measure.compile_stats import COMPILE_WORKER_RSS_BYTES, INPROCESS_COMPILE_RSS_BYTES, compile_workers

# Lazy imports below: transformers (training.models) loads only when a model's config is read, and strategies/pipeline.py
# (torch.distributed) only when a pipeline's parts are counted; the memory formulas need neither.

# Speed order measured on one H100 (benchmarks/results/h100-foundation.md, tok/s at gpt2-medium,
# seq 1024, micro 8, bf16): dp 57.2k > zero2 48.9k > fsdp 46.1k > zero2_offload 22.6k > zero3 21.0k.
# zero3 and zero2_offload are within noise of each other there (the file quotes ±10% for DeepSpeed);
# zero3 is ranked first because it keeps everything on the GPU and scales with more GPUs.
# The offloads for a model that does not fit, side by side on one H100 (benchmarks/results/*-h100-big-model,
# calls 6-7: bloom-7b1, global batch 32, checkpointing, exact AdamW): ao_offload 24.3% MFU > fsdp_offload 14.4% >
# zero3_offload 9.5% (--offload-ratio 0.7; 18.3% fully offloaded on a larger host); zero2_offload 24.8% on that larger
# host, so ao_offload stays after it. zero0/zero1/zero1_offload/infinity were not measured: placed by
# reasoning (zero0, zero1 ~ zero2 communication; offloads slower than their GPU versions; NVMe slowest).
# Each strategy's rank is its spec's speed_rank (strategies/specs/); these are read from there.
SPEED_ORDER = speed_order()
MEASURED_SPEED = {s.name for s in all_specs() if s.speed_measured}

# DeepSpeed's default AIO swap buffers for ZeRO-Infinity (deepspeed/runtime/swap_tensor/constants.py &
# zero/offload_config.py): offload_param buffer_count 5 x buffer_size 1e8 elements (16-bit); the
# optimizer swapper keeps buffer_count 4 x (largest sub-group, 1e9 elements by default, capped at the
# partition) fp32. Approximate; pinned CPU memory.
INFINITY_PARAM_BUFFERS = 5 * 100_000_000 * 2


# --------------------------------------------------------------------------------------------------
# Architecture read from the config (and the meta-device model): Arch itself is memory.py's


def _pipeline_parts(model: Any) -> dict[str, Any] | None:
    from ..strategies.pipeline import model_parts, embedding_modules

    try:
        family, trunk, blocks, ln_f, lm_head = model_parts(model)
    except UserError:
        return None
    embed = list(embedding_modules(family, trunk).values())  # the token embedding first
    count = lambda mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    return {
        "embed": count(embed), "final_norm": count([ln_f]), "head": count([lm_head]), "blocks": [count([b]) for b in blocks],
        "tied": lm_head.weight is embed[0].weight, "vocab_x_hidden": embed[0].weight.numel(),
        "largest_block_param": max((p.numel() for b in blocks for p in b.parameters()), default=0),
    }



def arch_from_hf_config(hf_config: Any, *, name: str = "model", attn_impl: str = "sdpa", dropout: float | None = None,
                        persistence_threshold: int = 100_000) -> Arch:
    """Count parameters on the meta device and read the shape of ``hf_config``."""
    from transformers import AutoModelForCausalLM

    from ..training.models import transformer_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    seen: set[int] = set()
    n = 0
    persistent = 0
    sizes = []
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += p.numel()
        sizes.append((p.numel(), p.dim()))
        if p.numel() <= persistence_threshold:
            persistent += p.numel()
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    blocks = transformer_blocks(model)
    block_params = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    in_blocks = sum(p.numel() for p in {id(p): p for b in blocks for p in b.parameters()}.values())  # a shared one once
    family = model_family(hf_config)
    c = hf_config
    hidden = int(getattr(c, "hidden_size", None) or getattr(c, "n_embd"))
    layers = int(getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer"))
    heads = int(getattr(c, "num_attention_heads", None) or getattr(c, "n_head"))
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    ffn = int(getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden)
    if family == "gpt2":
        drops = (c.attn_pdrop, c.resid_pdrop, c.embd_pdrop)
    elif family == "bloom":
        drops = (c.attention_dropout, c.hidden_dropout, 0.0)
    else:
        drops = (float(getattr(c, "attention_dropout", 0.0) or 0.0), float(getattr(c, "hidden_dropout", 0.0) or 0.0), 0.0)
    if dropout is not None:  # shardlab's --dropout overrides every probability (train.apply_dropout)
        drops = (dropout, dropout, dropout if family == "gpt2" else 0.0)
    return Arch(
        model=name, family=family, n_params=n, largest_layer_params=largest_layer, block_params=block_params,
        root_params=n - in_blocks, persistent_params=persistent, hidden=hidden, layers=layers, heads=heads,
        kv_heads=kv_heads, ffn=ffn, vocab=int(c.vocab_size), attn_impl=attn_impl,
        attn_dropout=float(drops[0]), resid_dropout=float(drops[1]), embd_dropout=float(drops[2]),
        pipeline_parts=_pipeline_parts(model), param_sizes=tuple(sizes), leaf_classes=tuple(zero3_leaf_classes(model)),
    )


def _planned_attn(cfg: RunConfig, hf_config: Any) -> str:
    """The attention implementation a CUDA run would get (flash and SDPA keep the same tensors)."""
    from ..training.models import causal_lm_class, supports_attention

    cls = causal_lm_class(hf_config)
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    return "sdpa" if supports_attention(cls, "sdpa") else "eager"


# --------------------------------------------------------------------------------------------------
# Formulas side by side


# torchao's AdamW8bit state layout (optim/adam.py _new_buffer, subclass_8bit.OptimState8bit): a tensor of at least
# EIGHT_BIT_MIN_NUMEL elements, a multiple of EIGHT_BIT_BLOCK, keeps each moment as 1 B codes plus an fp32 scale per
# block; smaller ones keep fp32 moments.
EIGHT_BIT_BLOCK, EIGHT_BIT_MIN_NUMEL = 256, 4096


def paper_bytes_per_param(strategy: str, d: int) -> Fraction | None:
    """ZeRO paper (Rajbhandari et al. 2020, Fig. 1, K = 12 for mixed-precision Adam): bytes per
    parameter per GPU: baseline 16, P_os 4 + 12/N, P_os+g 2 + 14/N, P_os+g+p 16/N."""
    s = spec(strategy)
    if not s.sharded and not s.offloads:  # dp, zero0: nothing sharded
        return Fraction(16)
    if s.offloads:  # the paper's figure has no offload
        return None
    if s.engine == "fsdp2":
        return Fraction(16, d)
    return {1: Fraction(4) + Fraction(12, d), 2: Fraction(2) + Fraction(14, d), 3: Fraction(16, d)}[s.zero_stage]


def deepspeed_estimates(arch: Arch, gpus_per_node: int, nodes: int) -> dict[str, dict[str, int]]:
    """DeepSpeed's own model-state estimators (deepspeed 0.19.8), as they compute them:
    ``stage_1_and_2.estimate_zero2_model_states_mem_needs`` and
    ``stage3.estimate_zero3_model_states_mem_needs`` (the ``*_all_cold`` variants print exactly
    these, with additional_buffer_factor 1.5). Returns {option: {gpu, cpu}} in bytes per GPU / per node."""
    # Computed with a transcription of those two functions (below) rather than by importing deepspeed:
    # the import takes seconds, logs on every machine without a GPU, and binds DeepSpeed's logger to
    # whatever stdout is current. tests/test_plan.py checks the transcription against DeepSpeed's code.
    z2, z3 = _ds_zero2_formula, _ds_zero3_formula
    n, ll = arch.n_params, arch.largest_layer_params
    out = {}
    cpu, gpu = z2(n, gpus_per_node, nodes, cpu_offload=False)
    out[_ds_name(2, None)] = {"gpu": gpu, "cpu": cpu}
    cpu, gpu = z2(n, gpus_per_node, nodes, cpu_offload=True)
    out[_ds_name(2, "cpu")] = {"gpu": gpu, "cpu": cpu}
    cpu, gpu, _ = z3(n, ll, gpus_per_node, nodes, cpu_offload=False, cpu_offload_params=False, zero_init=True)
    out[_ds_name(3, None)] = {"gpu": gpu, "cpu": cpu}
    cpu, gpu, _ = z3(n, ll, gpus_per_node, nodes, cpu_offload=True, cpu_offload_params=True, zero_init=True)
    out[_ds_name(3, "cpu")] = {"gpu": gpu, "cpu": cpu}
    return out


def _ds_name(stage: int, offload: str | None) -> str:
    """The DeepSpeed strategy of a ZeRO stage whose optimizer states live at `offload` (None: on the GPU);
    at stage 3 the parameters go with them."""
    params = offload if stage == 3 else None
    return find(engine="deepspeed", zero_stage=stage, offload_optimizer=offload, offload_params=params)


def _ds_zero2_formula(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def _ds_zero3_formula(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
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


# --------------------------------------------------------------------------------------------------
# Per-strategy prediction


def _model_states(strategy: str, n: int, d: int, precision: str, optimizer: str = "adamw",
                  in_backward: bool = False, master_weights: str = "fp32") -> tuple[Fraction, Fraction, Fraction, str]:
    """(params, grads, optimizer) bytes per parameter on each GPU and where the states live (what lives
    in host memory instead: ``host_states``). ``d`` = data-parallel world size. `optimizer`/`in_backward`
    (dp, fsdp): torchao's AdamW8bit keeps 1 B per moment plus an fp32 scale per 256-element block;
    a step in backward frees each gradient as soon as it is applied (none left for a whole model);
    `master_weights='bf16'` (dp): bf16 weights and gradients, no fp32 copy anywhere."""
    F = Fraction
    s = spec(strategy)
    mixed = precision != "fp32"
    lo = F(2) if mixed else F(4)  # DeepSpeed's working copy of params/grads
    # The fp32 master copy. fp32 runs update the params themselves, except under ZeRO 1-3, which step a copy even then:
    # stage_1_and_2.py clones the partition (single_partition_of_fp32_groups: .clone().float()), and stage3.py's
    # _create_fp32_partitions shares it only when the partition's torch.device equals the accelerator's device *name*
    # (a str: never equal), so it clones too. Measured on the CPU, gpt2 fp32 (benchmarks/diag/cpu_census.py): zero2 and
    # zero3 hold a 0.464 GiB master beside the 0.464 GiB params (benchmarks/results/*-cpu-host-model).
    master = F(4) if mixed or (s.engine == "deepspeed" and s.zero_stage >= 1) else F(0)
    adam = F(8)
    torch_adam = F(2) + F(2 * 4, EIGHT_BIT_BLOCK) if optimizer == "adamw8bit" else adam
    weight = F(2) if master_weights == "bf16" else F(4)
    torch_grads = F(0) if in_backward else weight
    if s.engine == "ddp":
        if master_weights == "bf16":
            return weight, torch_grads, torch_adam, "bf16 weights and grads (no fp32 copy), 8-bit AdamW m and v on every GPU"
        return F(4), torch_grads, torch_adam, "fp32 weights, fp32 grads, fp32 AdamW m and v on every GPU"
    if s.engine == "torchao":  # torchao CPUOffloadOptimizer: device gradients freed once copied to the host
        return F(4), F(0), F(0), "fp32 weights on the GPU; AdamW states, step and host copies on the CPU"
    if s.engine == "fsdp2":
        if s.offload_params == "cpu":
            return F(0), F(0), F(0), "fp32 params, grads, AdamW states sharded, kept on the CPU"
        return F(4, d), torch_grads / d, torch_adam / d, "fp32 params, grads, AdamW states sharded across GPUs"
    stage = s.zero_stage
    opt = master + adam
    if stage == 0:
        return lo, lo, opt, "nothing sharded"
    if s.offload_optimizer is None:
        params = lo if stage < 3 else lo / d
        grads = lo if stage == 1 else lo / d
        return params, grads, opt / d, f"ZeRO-{stage} on the GPUs"
    if s.offload_params is None:
        return lo, F(0), F(0), "optimizer states and gradient partitions on the CPU"
    if s.offload_params == "cpu":
        return F(0), F(0), F(0), "parameters, gradients and optimizer states on the CPU"
    return F(0), F(0), F(0), "parameters and optimizer states on NVMe"  # infinity: gradient partitions on the CPU


def eight_bit_state_bytes(k: int) -> int:
    """GPU bytes of torchao AdamW8bit's two moments for a tensor of `k` elements (the layout above)."""
    if k >= EIGHT_BIT_MIN_NUMEL and k % EIGHT_BIT_BLOCK == 0:
        return 2 * (k + 4 * (k // EIGHT_BIT_BLOCK))
    return 2 * 4 * k


def eight_bit_warmup_bytes(k: int, weight_bytes: int) -> int:
    """GPU bytes above the weights while shardlab compiles and autotunes torchao's 8-bit step for one parameter shape
    of `k` elements before training (training/warm_8bit.py): a scratch copy of the weight, its gradient and its two
    moments, the autotuner's clones of what the step mutates (the weight and the moments), and the compiled step's own
    temporaries, measured as two weight-sized and two fp32 tensors of the shape. Measured on an H100/H200
    (benchmarks/results/*-h100-8bit-warmup): bloom-7b1's embedding with bf16 weights 21.17 GiB above the
    weights (22.12 B/element; this gives 22.06), gpt2-medium's with fp32 weights 1.505 under dp and 1.495 under fsdp
    (31.2-31.4 B/element; this gives 32.06)."""
    return 5 * weight_bytes * k + 2 * eight_bit_state_bytes(k) + 8 * k


def eval_batch_per_rank(cfg: RunConfig, strategy: str, micro: int, accum: int, dp: int, eval_blocks: int | None) -> int:
    """Rows of one eval forward on one rank (training.trainer._loaders): the eval batch is the micro batch (a whole
    step's micro-batches where the strategy evaluates whole steps), and DistributedSampler gives every rank
    ceil(blocks / ranks) rows (drop_last=False pads). With ``eval_blocks`` unknown (the launcher plans before the data
    is read) a full eval batch: what an eval split of at least ``dp`` batches uses. 0 when there is no eval split."""
    if cfg.dataset.eval_split <= 0 or eval_blocks == 0:
        return 0
    batch = spec(strategy).eval_batch(micro, accum)
    if eval_blocks is None:
        return batch
    return min(batch, math.ceil(eval_blocks / max(1, dp)))


def eval_loss_bytes(mode: str, tokens: int, vocab: int, chunk_mib: int) -> float:
    """GPU bytes of an eval forward's loss (no grad) over ``tokens`` rows of logits: the model's logits in the compute
    dtype, and beside them one chunk's fp32 working memory (loss.chunked_causal_lm_loss: the chunk's fp32 copy and
    fp32 log-softmax, 8 B a logit; 4 B for fp32 logits, whose ``.float()`` is the same tensor). ``chunk_mib`` 0 = the
    whole batch as one chunk, which is what the eager loss did before (measured at bloom-3b zero3_offload, 6 eval rows
    of 1024 tokens on one H200, benchmarks/results/*-h100-z3off-plan: 2,940 MiB + 2 x 5,880 MiB, 2 + 4 + 4 B a
    logit)."""
    logit, work = (4, 4) if mode == "fp32" else (2, 8)
    chunk = min(tokens, eval_chunk_tokens(vocab, chunk_mib) or tokens)
    return float(logit * tokens * vocab + work * chunk * vocab)


def _strategy_plan(strategy: str, arch: Arch, cfg: RunConfig, micro: int, accum: int, precision: str,
                   gpus_per_node: int, nodes: int, checkpointing: bool, ds_est: dict[str, dict[str, int]],
                   device: str = "cuda", eval_blocks: int | None = None) -> StrategyPlan:
    """One strategy's prediction. ``device='cpu'`` predicts a CPU run's allocations instead (CPU activation
    layout, torch's AdamW temporaries), which ``shardlab train --device cpu`` records and
    ``--micro-batch auto`` caps by a host-RAM budget. ``eval_blocks``: the eval split's size in blocks, when known
    (``eval_batch_per_rank``)."""
    s = spec(strategy)
    if s.engine == "pipelining":
        sp = pipeline_strategy_plan(arch, cfg, micro, accum, precision, gpus_per_node, nodes, checkpointing, device)
        sp.micro_batch, sp.grad_accum = micro, accum
        return sp
    n = arch.n_params
    d = gpus_per_node * nodes
    opts = cfg.strategy_options
    mixed = precision != "fp32"
    lo = 2 if mixed else 4
    bf16_master = cfg.master_weights == "bf16" and s.supports_bf16_master
    P, G, O, where = _model_states(strategy, n, d, precision, cfg.optimizer, cfg.optimizer_in_backward,
                                   "bf16" if bf16_master else "fp32")
    params, grads, optim = float(P * n), float(G * n), float(O * n)
    on_gpu: list[int] = []
    if s.engine == "deepspeed" and s.offload_params == "cpu":
        on_gpu, on_host = zero3_optimizer_split(strategy, arch, cfg, d, device)
    if on_gpu:
        # Partial offload (Twin-Flow; DeepSpeed 0.19.8 runtime/zero/stage3.py): a GPU sub-group keeps its fp32 master
        # (_create_fp32_partitions l.1157-1160), its fp32 gradient buffer (initialize_optimizer_states l.1337-1342;
        # never freed under offload: _release_sub_group l.2733-2734) and, from the first step, torch AdamW's m and v
        # (the "backup" optimizer that steps the GPU sub-groups, l.313-326 and l.1249-1258): 16 B per element.
        g = sum(on_gpu)
        grads += 4.0 * g
        optim += 12.0 * g
        where = (f"Twin-Flow (offload ratio {opts.offload_ratio}): {len(on_gpu)} of {len(on_gpu) + len(on_host)} optimizer "
                 f"sub-groups ({g:,} elements: fp32 master, grads, AdamW m, v) on the GPU; the rest, the 16-bit params "
                 "and 16-bit grads on the CPU")
    if s.engine == "torchao" and accum > 1:
        # strategies/ao_offload.py: offload_gradients only with one micro-batch a step; accumulating keeps the fp32
        # gradients on the GPU until step(). Measured bloom-3b m8 x 8: 53.61 GiB, 35.91 planned without these and the
        # autocast copies below (benchmarks/results/*-h100-offload).
        grads = 4.0 * n
    if s.engine == "ddp" and not bf16_master:
        mode = "autocast" if mixed else "fp32"
    else:  # the engine's 16-bit weights, or dp's bf16 master weights (no autocast: Strategy.autocast)
        mode = "lp" if mixed else "fp32"
    kernel = resolve_loss_kernel(cfg.loss_kernel, device)
    act = activation_bytes(arch, micro, cfg.seq_len, mode, device, checkpointing, kernel, compiled=cfg.compile)
    temp: dict[str, float] = {}  # live at the start of backward
    temp_step: dict[str, float] = {}  # live at the end of backward / optimizer step
    at_head: dict[str, float] = {}  # live besides `temp` once the loss' backward is done and the gradient reaches the head
    persistent_temp: dict[str, float] = {}  # allocated once, live throughout
    if mode != "autocast" and not cfg.compile and pads(cfg, device, kernel, arch.vocab):
        # training/head_padding.py runs the head's matmul on a copy of its weight padded to a multiple of 64 rows, which
        # the matmul saves for backward. Under autocast it takes the place of autocast's own 16-bit copy; over the
        # engine's own weights it is one more (gpt2 zero2_offload seq 512, one H100: 0.072 GiB at the peak,
        # benchmarks/diag/peak_snapshot.py, benchmarks/results/*-h100-plan-validation). Compiled, inductor recomputes the pad.
        temp["pad_head: the head weight padded to a multiple of 64 rows (saved for backward)"] = float(
            lo * padded_vocab(arch.vocab) * arch.hidden)
    notes: list[str] = []
    stage = s.zero_stage
    eval_gathered = 0.0  # ZeRO-3 parameters still gathered during an eval forward's loss
    # ZeRO-3 without contiguous gradients: the gradients its reduce holds at the end of backward, and all it holds then
    grads_held, reduce_held, reduce_what = 0.0, 0.0, ""
    fsdp_reduce = (0.0, "")  # FSDP2's reduce-scatter of its largest unit at the end of backward (bytes beside the states)
    if device == "cpu" and s.engine in ("ddp", "fsdp2") and not s.offloads and cfg.optimizer == "adamw":
        # optim.adamw: fused on CUDA (no temporaries), and for offloaded states (fsdp_offload). On the CPU torch
        # takes the single-tensor path (foreach kernels are for accelerators): each parameter's sqrt(v) and its
        # quotient, freed before the next one.
        temp_step["AdamW per-tensor temporaries (CPU)"] = cpu_adamw_temp_bytes(arch.largest_layer_params / (
            d if s.engine == "fsdp2" else 1))
    if s.engine == "ddp":
        if mixed and not bf16_master:
            temp["autocast 16-bit weight copies (saved for backward)"] = 2.0 * n
        if d > 1:
            persistent_temp["DDP gradient buckets (gradient_as_bucket_view=False)"] = 4.0 * n
    elif s.engine == "fsdp2":
        from ..strategies.fsdp import accumulated_grad_bytes_per_param, params_gathered_through_backward

        # Accumulating: the whole model's unsharded gradients stay on the GPU between micro-batches, in fp32, even
        # under CPUOffloadPolicy (they replace the sharded ones, freed by zero_grad(set_to_none=True) at the step).
        accumulated = accumulated_grad_bytes_per_param(accum) * n
        if accumulated:
            temp["unsharded fp32 gradients accumulated between micro-batches (whole model)"] = accumulated
        # 16-bit (or fp32) unsharded copies. No reshard after forward (fsdp_reshard_after_forward=false, and its default
        # on one rank without parameter offload): every unit's, from its forward to its backward, the whole model at the
        # start of backward; then a block's unsharded grads and their fp32 upcast.
        # Resharding frees every unit after its forward, the root's too: none is gathered while the loss runs its
        # backward; the root (embeddings, final norm, head) is gathered again when the gradient reaches the head, as
        # are one block at a time in backward (params, 16-bit grads, their fp32 upcast, + the prefetched next block).
        if params_gathered_through_backward(cfg, d, strategy):
            temp["unsharded params kept gathered from forward to backward (no reshard after forward)"] = float(lo * n)
            at_head["unsharded block grads and their fp32 upcast (backward)"] = float((lo + (4 if mixed else 0)) * arch.block_params)
        else:
            at_head["unsharded root params (gathered again for the head's backward)"] = float(lo * arch.root_params)
            at_head["unsharded block params/grads (backward, + prefetch)"] = float((2 * lo + (4 if mixed else 0)) * arch.block_params)
        at_head["the head's unsharded 16-bit weight gradient (root unit)"] = float(lo * arch.root_params)
        temp_step["fp32 grads before reduce-scatter"] = 0.0
        from ..strategies.fsdp import units

        if units(cfg, d, strategy) == "blocks":
            # The last unit reduced, the root (embeddings, tied head), reduces after the embedding's backward, when the
            # activations are gone: its unsharded 16-bit gradients, the fp32 reduce-scatter input they are copied into
            # (foreach_reduce), and every sharded gradient (the output becomes the root's shard). bloom-7b1 fsdp on two
            # H200s, micro 8, checkpointing: 59.2 GiB measured, 52.7 planned at the optimizer step without this moment.
            unit = max(arch.root_params, arch.block_params)
            fsdp_reduce = ((lo + 4.0) * unit, "the largest unit's unsharded gradients and their fp32 reduce-scatter input")
        if units(cfg, d, strategy) == "model":
            # one unit: its reduction runs once, at the end of backward, over the whole model: the fp32 (reduce_dtype)
            # input buffer beside the reduced output that becomes the sharded gradients (counted in `grads`)
            temp_step["fp32 reduce-scatter input of the whole model (one FSDP unit)"] = 4.0 * n
    else:  # DeepSpeed; and torchao (ao_offload), which has no stage and is counted as stage 3 below, as before

        if s.engine == "torchao" and mixed:  # fp32 weights under autocast, as dp (bloom-7b1 m32: +13.2 GiB measured)
            temp["autocast 16-bit weight copies (saved for backward)"] = 2.0 * n

        buckets = sized_buckets(opts, n, arch.hidden, s.offload_optimizer, d, s.offload_params is not None)  # what the engine gets
        rb, ab = buckets["reduce_bucket_size"], buckets["allgather_bucket_size"]
        if device == "cpu":  # torch.empty buckets count in host RSS only where written: at most the model's size
            rb = min(rb, n)
        overlap = overlap_comm(opts, d, s.offload_optimizer)
        if stage in (0,):
            temp_step["fp32 gradient copy for the step (FP16_Optimizer)"] = 4.0 * n
        elif stage in (1, 2):
            # On a CPU the bucket is host memory that becomes resident only as backward writes gradients into it, past
            # the activations' peak, and is freed at the end of backward (_release_ipg_buffers): gpt2 zero2 on one CPU
            # rank peaked at its states + activations in backward (benchmarks/results/*-cpu-host-model)
            if contiguous_gradients(opts, stage, d, s.offloads) and device != "cpu":
                k = 2 if overlap else 1
                temp[f"reduce bucket {rb:,} x {lo} B" + (" x2 (overlap_comm)" if overlap else "")] = float(k * rb * lo)
            if s.offload_optimizer is not None:
                # ZeRO-Offload's GPU twin of the host staging buffer (stage_1_and_2.py __init__,
                # temp_grad_buffer_for_gpu_offload): the largest parameter in 16 bits, for the whole run. Missing, the
                # plan validation grid had zero2_offload 0.22-0.27 GiB low (gpt2 seq 512: -19.6%; benchmarks/results/*-h100-plan-validation)
                persistent_temp["GPU gradient staging buffer (largest parameter)"] = float(lo * arch.largest_param)
            if s.offload_optimizer is None:
                temp_step["fp32 gradient partition for the step"] = 4.0 * n / d
                if device == "cpu" and cfg.optimizer == "adamw":
                    # DeepSpeed without offload on a CPU steps torch's AdamW (deepspeed_zero.use_deepspeed_optimizer)
                    # over its flat fp32 partition of each param group (gpt2 fp32, one rank: zero2's and zero3's step
                    # peaked 3 x 0.464 GiB over their states: those temporaries and the fp32 gradient). stage_1_and_2.py
                    # steps one group at a time, and frees the group's 16-bit gradients once made fp32
                    # (free_grad_in_param_list), before its AdamW step: only what the temporaries exceed them counts
                    k = max(math.ceil(sum(g) / d) for g in ds_group_params(arch, cfg.weight_decay))
                    temp_step["AdamW temporaries over the flat fp32 partition (CPU), beyond the gradients freed before"] = max(
                        0.0, cpu_adamw_temp_bytes(k) - lo * k)
            elif gpu_grad_accum_fp32(cfg, strategy, precision, accum):
                # data_types.grad_accum_dtype=fp32 (shardlab's, or a user JSON's): the micro-batches' gradients summed
                # on the GPU, copied out once. A user JSON's bf16 keeps DeepSpeed's host accumulation: no GPU buffer
                # (bloom-3b m16 x 4: 49.32 GiB measured, planned 60.23 before this read the JSON)
                persistent_temp["fp32 gradient accumulation partition (on the GPU)"] = 4.0 * n / d
            if d > 1:
                notes.append(f"allgather_bucket_size {ab:,} is used in place (all_gather_into_tensor), no extra buffer counted")
        else:  # stage 3
            if contiguous_gradients(opts, stage, d, s.offloads):
                persistent_temp[f"ZeRO-3 reduce bucket {rb:,} x {lo} B"] = float(rb * lo)
            if stage == 3 and not s.offloads:
                persistent_temp["ZeRO-3 gradient partition flat buffer"] = float(lo * n / d)
                if not contiguous_gradients(opts, stage, d, s.offloads):
                    # Without contiguous gradients (one-rank ZeRO-3's default) the reduce bucket is a list of the
                    # parameters' own gradients, reduced once it holds reduce_bucket_size elements (at the end of
                    # backward when that is the whole model), and DeepSpeed's reduce_scatter_coalesced first flattens
                    # them into one more copy (torch.cat). gpt2 fp32, micro 1 x 256, one H200: 3.31 GiB measured, 2.81
                    # planned without this, the 148 gradients and a 0.46 GiB flat copy alive at the peak
                    # (benchmarks/results/*-cpu-host-model/gpu-call1/z3-fp32-peak-snapshot.txt). One-rank
                    # ZeRO-3's identity_reduce_scatter (strategies/zero3_one_rank.py) makes no copy: the gradients only.
                    flat_copy = "identity_reduce_scatter" not in one_rank_shortcuts(opts, stage, d, s.offloads)
                    grads_held = float(lo * min(rb, n))
                    reduce_held = (2.0 if flat_copy else 1.0) * grads_held
                    reduce_what = "the gradients it holds" + (" and their flat copy" if flat_copy else "")
                # The step, one sub-group at a time (stage3.py _prepare_fp32_grad_for_sub_group): the sub-group's
                # gradients flattened and made fp32 (a 16-bit flat copy, then its fp32 one; fp32's .to is the same
                # tensor), freed after that sub-group's step; on a CPU torch's AdamW then steps the flat fp32 master.
                _, subs = zero3_optimizer_split(strategy, arch, cfg, d, device)
                k = max(subs)
                step_temp = 4.0 * k + (lo * k if mixed else 0.0)
                if device == "cpu" and cfg.optimizer == "adamw":
                    step_temp = max(step_temp, 4.0 * k + cpu_adamw_temp_bytes(k))
                temp_step["fp32 gradient of the largest optimizer sub-group (step)"] = step_temp
            # A leaf module (a whole decoder block) is fetched as one unit, so the largest unit gathered at once is a block.
            unit = max(arch.largest_layer_params, arch.block_params if arch.leaf_classes and block_leaves(opts, stage, s.offloads) else 0)
            gather = min(opts.stage3_max_live_parameters, unit + buckets["stage3_prefetch_bucket_size"])
            if device == "cpu":
                gather = min(gather, n)
            label = "ZeRO-3 gathered params (largest layer or leaf block + prefetch bucket)"
            if d > 1 or (stage == 3 and s.offload_params is not None):
                # Gathered copies are allocations of their own here (one GPU without parameter offload showed no
                # such extra: its cells are within -6.2%..+3.6% with the allowance above). DeepSpeed keeps a gathered
                # parameter whose next use lies within stage3_max_reuse_distance parameters of the module trace
                # (partitioned_param_coordinator.__params_to_release); after forward the next uses are backward's,
                # so up to that many parameters stay gathered at the start of backward. Measured: gpt2-large
                # zero3_offload -16.4% and zero3 on 2/4 GPUs -6.6%/-7.5% with the largest-layer allowance alone,
                # -1.0% and -0.7%/-0.6% with this (benchmarks/results/*-h100-session3/).
                kept = min(n, opts.stage3_max_reuse_distance + buckets["stage3_prefetch_bucket_size"])
                if kept > gather:
                    gather, label = kept, "ZeRO-3 gathered params kept for reuse in backward (stage3_max_reuse_distance)"
            if buckets["stage3_param_persistence_threshold"] >= n:  # one rank: every parameter persists, none is gathered
                gather, label = 0, "ZeRO-3 gathered params (none: every parameter persists on one rank)"
            temp[label] = float(lo * gather)
            # An eval forward after training replays the training trace, so it keeps the same gathered params (their
            # next use is the backward that does not come): bloom-3b zero3_offload's final eval held the embedding and
            # the last blocks' weights, 1.87 GiB, on one GPU (16.30 GiB measured, no initial eval). With the initial eval
            # (the default) DeepSpeed alone kept the eval trace's release decisions for the whole run (its lru_cache'd
            # __params_to_release, never cleared): nothing beyond the persistent params was left at bloom-7b1's evals
            # (14.45 GiB). shardlab clears that cache when a new trace completes (strategies/zero3_release_cache.py), so
            # the final eval holds these params with or without the initial eval (CPU: tests/test_zero3_release_cache.py).
            eval_gathered = float(lo * gather)
            persistent_temp["ZeRO-3 persistent small params (whole on every GPU)"] = float(lo * arch.persistent_params * (1 - 1 / d))
            if on_gpu:
                # torch AdamW's foreach step (torch/optim/adam.py _multi_tensor_adam: every update in place but
                # exp_avg_sq_sqrt = _foreach_sqrt(v)), one GPU sub-group at a time (stage3.py step l.2909-2927)
                temp_step["AdamW sqrt(v) of the largest GPU sub-group (Twin-Flow step)"] = 4.0 * max(on_gpu)
    grads_live_fb = accum > 1 or bool(on_gpu)  # set_to_none=True frees grads between steps; accumulation keeps them
    if stage == 3 and not s.offloads:
        grads_live_fb = True  # the flat buffer is persistent; counted in persistent_temp, grads are views of it
        grads_counted_in_buffer = True
    else:
        grads_counted_in_buffer = False
    g_fb = grads if (grads_live_fb and not grads_counted_in_buffer) else 0.0
    if s.engine == "fsdp2":
        g_fb = 0.0  # accumulating, FSDP2 keeps unsharded gradients instead of the shards: counted in `temp`
    g_end = 0.0 if grads_counted_in_buffer else grads
    static = params + optim + sum(persistent_temp.values())
    # Start of backward: the saved activations and the loss' gradients. Not a checkpointed layer's recomputation: that
    # comes after the loss' and the head's backward have freed the logits' tensors (moment_layer below). Counting both
    # at once put bloom-7b1 zero3_offload (micro 8, checkpointing) at 13.14 GiB where 12.25 was measured on 2 GPUs,
    # the logits (3.83 + 3.83), the tied embedding kept gathered (1.91), the layers' inputs (1.88) and the ALiBi bias
    # (0.5) and nothing else at the peak; bloom-3b 11.41 / 11.42 on 1 / 2 GPUs (benchmarks/results/*-h100-z3off-plan).
    moment_fb = static + g_fb + act.peak - act.recompute + sum(temp.values())
    # a moment later: the loss' backward has left only the logits' gradient, and what the head's backward gathers
    moment_head = moment_fb - act.logits_peak + act.logits_grad + sum(at_head.values())
    # a checkpointed layer's backward: its recomputed activations and its backward's temporaries (memory.layer_backward_bytes,
    # as the pipeline plan counts them); at most the logits' gradient is left of the loss (liger: its two gradients)
    moment_layer = 0.0
    if act.recompute:
        sbh = float(micro * cfg.seq_len * arch.hidden)
        moment_layer = (static + g_fb + act.layers + act.embed_final + act.recompute + layer_backward_bytes(arch, mode) * sbh
                        + act.logits_grad + sum(temp.values()))
    moment_end = static + g_end + sum(temp_step.values())
    moment_reduce = static + reduce_held if reduce_held else 0.0  # the activations are gone by then
    moment_fsdp_reduce = static + g_end + fsdp_reduce[0] if fsdp_reduce[0] else 0.0
    # A tied head (GPT-2, BLOOM): the embedding's backward, the last of backward, makes a whole vocab x hidden gradient
    # that autograd then adds into the head's, beside every other gradient of the model. gpt2 fp32, micro 1 x 256, one
    # H100 (peak snapshots, benchmarks/results/*-h100-zero3-one-rank/call5): dp 2.06 GiB measured, 1.88 planned
    # without it; one-rank zero3 with its gradients reduced in place 3.00 / 2.81: 0.608 GiB of gradients alive for
    # 0.464 GiB of parameters. Where the full gradients are alive at the end of backward: dp, and one-rank ZeRO-3's
    # reduce of the parameters' own gradients (other engines reduce or shard them during backward).
    parts = arch.pipeline_parts or {}
    moment_tied = 0.0
    if parts.get("tied") and s.engine == "ddp" and grads:
        moment_tied = static + g_end + grads / n * parts["vocab_x_hidden"]
    elif parts.get("tied") and grads_held:
        moment_tied = static + grads_held + lo * parts["vocab_x_hidden"]
    # An eval forward (shardlab evaluates before the first step, at epoch ends and after the last step): no activations
    # kept, but the logits at the per-rank eval batch. With the whole batch's fp32 copies (before the chunked eval loss)
    # this made zero3_offload's measured peak depend on the number of GPUs: bloom-7b1's 6 eval blocks are one batch of 6
    # on one GPU (2.87 + 2 x 5.74 GiB of logits: 14.45 GiB measured, above training's peak) and 3 per rank on two
    # (benchmarks/results/*-h100x2-ds-offload).
    moment_eval = 0.0
    eval_rows = eval_batch_per_rank(cfg, strategy, micro, accum, d, eval_blocks)
    if eval_rows and kernel != "liger":  # liger evaluates through its fused kernel too: no logits
        moment_eval = static + eval_gathered + eval_loss_bytes(mode, eval_rows * cfg.seq_len, arch.vocab, cfg.eval_loss_chunk_mib)
    # shardlab compiles and autotunes torchao's 8-bit step before training, one parameter shape at a time, beside the
    # weights alone (training/warm_8bit.py); the moments and gradients of the run do not exist yet
    moment_warm = 0.0
    if device == "cuda" and cfg.optimizer == "adamw8bit":
        shapes = {math.ceil(k / d) if s.engine == "fsdp2" else k for k, _ in arch.param_sizes} or {arch.largest_param}
        moment_warm = params + sum(persistent_temp.values()) + max(
            eight_bit_warmup_bytes(k, 2 if bf16_master else 4) for k in shapes)
    peak, moment = max((moment_fb, "start of backward (activations + loss gradients)"),
                       (moment_head, "backward at the LM head (activations + logits gradient + gathered root)"),
                       (moment_layer, "backward of a checkpointed layer (its recomputation + backward temporaries)"),
                       (moment_end, "optimizer step (all gradients + step buffers)"),
                       (moment_reduce, f"end of backward (ZeRO-3's reduce: {reduce_what})"),
                       (moment_tied, "end of backward (all gradients + the tied embedding's second gradient)"),
                       (moment_fsdp_reduce, f"end of backward (FSDP2's reduce-scatter: {fsdp_reduce[1]})"),
                       (moment_eval, f"eval forward ({eval_rows} rows a rank: their logits and one loss chunk)"),
                       (moment_warm, "compiling the 8-bit step before training (a scratch weight, gradient, moments, "
                                     "the autotuner's clones and the step's temporaries beside the weights)"),
                       key=lambda m: m[0])
    gpu = {
        "parameters": params,
        "gradients": (0.0 if grads_counted_in_buffer else grads),
        "optimizer": optim,
        "activations": act.layers + act.embed_final + act.recompute,
        "logits (loss)": act.logits_peak,
        "temporary": sum(temp.values()) + sum(persistent_temp.values()) + sum(at_head.values()),
        "step buffers": sum(temp_step.values()),
        "overhead (not in allocated)": float(CUDA_CONTEXT_BYTES),
    }
    detail = {**temp, **persistent_temp, **at_head, **temp_step}
    notes += [f"{k}: {v / GiB:.2f} GiB" for k, v in detail.items() if v]
    # CPU per node: the larger of the build moment and the training moment, per rank, times the ranks of a node
    states = host_states(strategy, arch, cfg, precision, d, accum, device)
    build_label, build = host_build(strategy, arch, precision, d, "bf16" if bf16_master else "fp32", device)
    nvme = 0.0
    if s.offload_params == "nvme":
        nvme = float(NVME_BYTES_PER_PARAM * n / nodes)
        states["AIO pinned param swap buffers (approx.)"] = float(INFINITY_PARAM_BUFFERS)
    baseline = GPU_PROCESS_RSS_BYTES if device == "cuda" else PROCESS_RSS_BYTES
    workers = compile_workers(cfg.compile) if device == "cuda" else 0
    if workers:  # inductor's pool for --compile runs (measure/compile_stats.py), sized from this machine's cores
        states[f"inductor compile workers ({workers} processes)"] = float(workers * COMPILE_WORKER_RSS_BYTES)
    if device == "cuda" and cfg.optimizer == "adamw8bit":
        # torchao compiles its step in this process (no worker pool: compile_stats.limit_compile_workers); inductor's
        # autotuning copies nothing to the host: shardlab runs it before training, its clones on the GPU (training/warm_8bit.py)
        states["torch.compile in the process (torchao's compiled 8-bit step)"] = float(INPROCESS_COMPILE_RSS_BYTES)
    cpu_detail = {k: v * gpus_per_node for k, v in states.items()}
    cpu_detail[build_label] = build * gpus_per_node
    cpu_detail["process (python, torch, CUDA libs)"] = float(baseline * gpus_per_node)
    cpu_total = gpus_per_node * max(PROCESS_RSS_BYTES + build, baseline + sum(states.values()))
    launcher = launcher_bytes(device, gpus_per_node) if device == "cuda" else 0  # a CPU run's total: cpu_run_bytes
    if launcher:
        cpu_detail["the process that launched the ranks"] = float(launcher)
        cpu_total += launcher
    ms_bpp = float(P + G + O) + 16.0 * sum(on_gpu) / n
    paper = paper_bytes_per_param(strategy, d)
    # ZeRO-Infinity: DeepSpeed's estimator has no NVMe variant; its CPU-offload figures stand in
    est = ds_est.get(strategy) or ({} if s.offload_params != "nvme" else ds_est.get(_ds_name(3, "cpu"), {}))
    return StrategyPlan(
        strategy=strategy, gpu=gpu, gpu_peak=peak, peak_moment=moment,
        cpu_per_node=cpu_total, cpu_detail=cpu_detail, nvme_per_node=nvme,
        model_state_bytes_per_param=ms_bpp, paper_bytes_per_param=None if paper is None else float(paper),
        deepspeed_gpu=est.get("gpu"), deepspeed_cpu=est.get("cpu"), notes=[where] + notes, micro_batch=micro, grad_accum=accum,
    )


def model_state_bytes_per_param(strategy: str, d: int, precision: str = "bf16") -> Fraction:
    """shardlab's parameters + gradients + optimizer states per GPU, bytes per parameter (exact)."""
    P, G, O, _ = _model_states(strategy, 1, d, precision)
    return P + G + O


# --------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    model: str
    family: str
    n_params: int
    largest_layer_params: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    precision: str
    gradient_checkpointing: bool
    attn_implementation: str
    gpus_per_node: int
    nodes: int
    gpu_memory: float
    gpu_memory_source: str
    host_ram: float | None
    nvme_free: float | None
    strategies: dict[str, StrategyPlan]
    recommendation: str | None
    reason: str
    next_option: str | None
    predicts: str = "peak torch.cuda.max_memory_allocated per GPU (bytes); fits adds the CUDA context and x1.15 fragmentation"
    compile: bool = False
    compile_modelled: bool | None = None  # --compile runs: whether their layers were planned as compiled (None: eager run)
    micro_auto: bool = False  # `--micro-batch auto`: each strategy planned at its own micro batch (StrategyPlan.micro_batch)
    notes: list[str] = field(default_factory=list)  # caveats: --compile not modelled, strategies left out, micro 'auto'
    # When no strategy fits with exact AdamW: the lightest-touch optimizer option that does (``_beyond_exact``), as the
    # flags to add, and its prediction. None when something exact fits or the run already asks for such options.
    recommended_flags: str | None = None
    recommended_plan: StrategyPlan | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _usable(gpu_memory: float) -> float:
    return gpu_memory - CUDA_CONTEXT_BYTES


def _fits(sp: StrategyPlan, gpu_memory: float, host_ram: float | None, nvme_free: float | None) -> tuple[bool, str]:
    need = sp.gpu_peak * RESERVED_OVER_ALLOCATED
    if need > _usable(gpu_memory):
        return False, f"GPU needs {need / GiB:.1f} GiB (peak {sp.gpu_peak / GiB:.1f} + fragmentation) of {_usable(gpu_memory) / GiB:.1f} usable"
    if host_ram is not None and not host_fits(sp.cpu_per_node, host_ram):
        return False, (f"CPU needs {sp.cpu_per_node / GiB:.1f} GiB (+{HOST_HEADROOM - 1:.0%} for the OS and the prediction's "
                       f"error) of {host_ram / GiB:.1f} GiB host RAM")
    nvme = spec(sp.strategy).offload_params == "nvme"
    if nvme and nvme_free is not None and sp.nvme_per_node > nvme_free:
        return False, f"NVMe needs {sp.nvme_per_node / GiB:.1f} GiB of {nvme_free / GiB:.1f} GiB free"
    if nvme and nvme_free is None:
        return True, f"GPU peak {sp.gpu_peak / GiB:.1f} GiB; needs {sp.nvme_per_node / GiB:.1f} GiB NVMe (free space not given)"
    return True, f"GPU peak {sp.gpu_peak / GiB:.1f} GiB, headroom {(_usable(gpu_memory) - need) / GiB:.1f} GiB"


def _detect_gpu_memory(cfg_device: str) -> float | None:
    try:
        if cfg_device != "cpu" and torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        return None
    return None


def _gpus_per_node(cfg: RunConfig) -> int:
    if cfg.gpus is not None:
        return cfg.gpus
    try:
        return max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)
    except Exception:
        return 1


def _dp_size(strategy: str, cfg: RunConfig, world: int) -> int:
    """Ranks that see different data (the batch triple's world): all but a pipeline's stages. Not refused here: the
    pipeline row's shape is (plan_pipeline.pipeline_layout), so that a full plan can leave it out."""
    return data_parallel_size(cfg, world, strategy)


def _arch(cfg: RunConfig) -> Arch:
    from ..training.models import build_hf_config

    hf_config = build_hf_config(cfg)  # unknown model / offline hub id / seq_len too long: models' UserErrors
    arch = arch_from_hf_config(hf_config, name=cfg.model, attn_impl=_planned_attn(cfg, hf_config), dropout=cfg.dropout,
                               # the user's threshold, else DeepSpeed's default (sized_buckets, which replaces it per
                               # strategy and world size where the engine does: offload, one rank)
                               persistence_threshold=sized_buckets(cfg.strategy_options, None, None, None)[
                                   "stage3_param_persistence_threshold"])
    from ..training.models import meta_loadable, resolve_preset

    arch.meta_build = meta_loadable(cfg)
    arch.random_init = resolve_preset(cfg.model) is not None
    return arch


def compile_is_modelled(cfg: RunConfig, arch: Arch | None = None) -> bool | None:
    """For a --compile run, whether its decoder layers are planned as compiled (memory.compiled_layers_modelled);
    None for an eager run."""
    if not cfg.compile:
        return None
    return compiled_layers_modelled(arch if arch is not None else _arch(cfg))


def plan(cfg: RunConfig, *, gpu_memory_gb: float | None = None, host_ram_gb: float | None = None,
         nvme_free_gb: float | None = None, strategies: tuple[str, ...] | None = None, max_search: int = 4096,
         eval_blocks: int | None = None) -> Plan:
    """Predict memory for every strategy of ``cfg`` (its model, seq_len, micro batch, GPUs, precision).

    ``gpu_memory_gb``: per-GPU memory in GiB (2**30 bytes; GPU memory is built in binary units: an
    "80GB" H100 has 80 GiB of HBM, of which torch reports ~79.1 GiB), detected with torch.cuda when
    omitted, required when no GPU is visible. ``host_ram_gb`` / ``nvme_free_gb``: per node, GiB too.
    ``micro_batch: auto`` is planned at the largest micro batch predicted to fit ``cfg.strategy``.
    ``eval_blocks``: the eval split's size in blocks where known (the eval forward's batch per rank,
    ``eval_batch_per_rank``); unknown, a full eval batch is planned.
    """
    for name, value in (("--gpu-memory-gb", gpu_memory_gb), ("--host-ram-gb", host_ram_gb), ("--nvme-free-gb", nvme_free_gb)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UserError(f"{name} must be a positive number of GB, got {value}", f"pass e.g. {name} 80")
    for s in strategies or ():
        if s not in names():
            raise UserError(f"unknown strategy {s!r}", f"choose from {', '.join(names())}")
    if cfg.deepspeed_config:
        notes_ds = ("of a user DeepSpeed JSON plan reads only data_types.grad_accum_dtype: buckets are shardlab's "
                    "strategy_options")
    else:
        notes_ds = ""
    arch = _arch(cfg)  # an unknown model is the first problem to report, before a missing GPU
    if gpu_memory_gb is not None:
        gpu_memory, source = gpu_memory_gb * GiB, "given"
    else:
        detected = _detect_gpu_memory(cfg.device)
        if detected is None:
            raise UserError("no CUDA GPU visible to read its memory from",
                            "pass --gpu-memory-gb (e.g. 80 for an H100 80GB), or --device cpu to plan a run on this machine's CPU")
        gpu_memory, source = detected, "detected (GPU 0)"
    gpus_per_node = _gpus_per_node(cfg)
    d = gpus_per_node * cfg.nodes
    precision = cfg.precision if cfg.precision != "auto" else "bf16"  # plan is for GPUs: auto = bf16 (A100/H100)
    plan_notes: list[str] = []
    host_ram = host_ram_gb * GiB if host_ram_gb is not None else None
    nvme_free = nvme_free_gb * GiB if nvme_free_gb is not None else None
    auto_cfg = cfg if cfg.micro_batch == "auto" else None  # each strategy then gets its own micro batch, below
    if auto_cfg is not None:
        dp_main = _dp_size(cfg.strategy, cfg, d)
        check_auto_batch(cfg, dp_main)
        micro_auto, why = _auto_micro(arch, cfg, cfg.strategy, precision, gpus_per_node, dp_main,
                                      lambda sp: sp.gpu_peak * RESERVED_OVER_ALLOCATED <= _usable(gpu_memory), "cuda", max_search,
                                      eval_blocks)
        cfg = cfg.model_copy(update={"micro_batch": max(1, micro_auto)})
        plan_notes.append(f"micro batch 'auto': each strategy is planned at its own largest micro batch predicted to fit GPU and "
                          f"host memory (column 'micro x accum'; {cfg.strategy}: {cfg.micro_batch}, {why}); "
                          "`shardlab train --micro-batch auto` confirms its strategy's with short trial runs")
    micro, accum, _ = cfg.resolve_batch(_dp_size(cfg.strategy, cfg, d))
    compile_modelled = compile_is_modelled(cfg, arch)
    if compile_modelled:
        plan_notes.append(
            "--compile: the decoder layers are counted as inductor saves them (fewer, 16-bit tensors: planning/memory.py "
            "_compiled_layer_bytes; gpt2-medium dp micro 16 on an H100: 22.1 GiB planned, 22.2 measured; with pad_head=false "
            "23.7 measured, not modelled), the embedding and the loss as in eager runs")
    elif cfg.compile:
        plan_notes.append(
            f"--compile is NOT modelled for the {arch.family} family (its compiled layers were never traced): these are "
            "eager-mode predictions, an upper bound; inductor recomputes cheap ops instead of saving them")
    if cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        plan_notes.append(f"compile_mode {cfg.compile_mode!r} captures CUDA graphs, whose static memory pools are not modelled: "
                          "the GPU peak can be higher than planned")
    if cfg.optimizer == "adamw8bit":
        plan_notes.append("--optimizer adamw8bit: torchao compiles its step in the process (counted on the host); shardlab "
                          "compiles and autotunes it before training, beside the weights alone, so inductor's autotuner "
                          "clones on the GPU and copies nothing to the host")
    if resolve_loss_kernel(cfg.loss_kernel, "cuda") == "compiled":
        plan_notes.append("the loss is shardlab's compiled kernel (loss_kernel): 4 bytes per logit at the start of backward "
                          "in 16-bit runs, against 12 for the model's own loss (--set loss_kernel=hf)")
    elif cfg.loss_kernel == "liger":
        plan_notes.append("the loss is Liger-Kernel's fused linear cross-entropy (loss_kernel=liger): no logits; the head "
                          "weight's gradient is held from forward to backward instead")
    ds_est = deepspeed_estimates(arch, gpus_per_node, cfg.nodes)
    out: dict[str, StrategyPlan] = {}
    for s in strategies or names():
        if spec(s).single_process and d > 1 and not strategies:  # e.g. torchao's offload (strategies/ao_offload.py)
            plan_notes.append(f"{s} left out: it runs on one GPU only")
            continue
        if spec(s).engine == "pipelining":  # as `train --strategy pipeline` runs it: without --microbatches, its default
            s_micro, s_accum, _ = cfg.model_copy(update={"strategy": s}).with_pipeline_microbatches(d)[0].resolve_batch(_dp_size(s, cfg, d))
        elif auto_cfg is not None:
            s_micro, s_accum = _own_auto_micro(s, arch, auto_cfg, precision, gpus_per_node, d, gpu_memory, host_ram, nvme_free,
                                               max_search, eval_blocks)
        else:
            s_micro, s_accum = micro, accum
        try:
            sp = _strategy_plan(s, arch, cfg, s_micro, s_accum, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing, ds_est,
                                eval_blocks=eval_blocks)
        except UserError as err:
            if not isinstance(err, PipelineNotApplicable) or strategies:
                raise
            plan_notes.append(f"{s} left out: {err.message}")
            continue
        sp.fits, sp.why = _fits(sp, gpu_memory, host_ram, nvme_free)
        sp.headroom = _usable(gpu_memory) - sp.gpu_peak * RESERVED_OVER_ALLOCATED
        if notes_ds:
            sp.notes.append(notes_ds)
        sp.max_micro_batch = _largest_micro(s, arch, cfg, s_accum, precision, gpus_per_node, gpu_memory, ds_est, max_search)
        out[s] = sp
    rec, reason, nxt = _recommend(out, arch, cfg, gpus_per_node)
    flags, option = None, None
    if rec is None and not strategies:
        found = _beyond_exact(arch, cfg, precision, gpus_per_node, gpu_memory, host_ram, nvme_free, ds_est, max_search)
        if found is not None:
            rec, flags, option, option_cfg = found
            reason = f"no strategy fits with exact fp32 AdamW ({reason}); {rec} fits with {arithmetic(option_cfg)}"
            nxt = None
    return Plan(
        model=cfg.model, family=arch.family, n_params=arch.n_params, largest_layer_params=arch.largest_layer_params,
        seq_len=cfg.seq_len, micro_batch=micro, grad_accum=accum, precision=precision,
        gradient_checkpointing=cfg.gradient_checkpointing, attn_implementation=arch.attn_impl,
        gpus_per_node=gpus_per_node, nodes=cfg.nodes, gpu_memory=gpu_memory, gpu_memory_source=source,
        host_ram=host_ram, nvme_free=nvme_free, strategies=out, recommendation=rec, reason=reason, next_option=nxt,
        compile=cfg.compile, compile_modelled=compile_modelled, notes=plan_notes, micro_auto=auto_cfg is not None,
        recommended_flags=flags, recommended_plan=option,
    )


def _own_auto_micro(s: str, arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, d: int, gpu_memory: float,
                    host_ram: float | None, nvme_free: float | None, max_search: int, eval_blocks: int | None) -> tuple[int, int]:
    """(micro, accum) for strategy ``s`` under `--micro-batch auto`: its largest micro batch that fits GPU and host memory
    (1 when none does, so the table still says why not). One micro batch for every strategy would plan them all at the
    configured strategy's: for bloom-7b1 on one 80 GB GPU and a global batch of 32, dp's (none fits, so 1 x accum 32),
    where fsdp_offload fits all 32 without accumulation (14.4% MFU measured at 32 x 1, 10.8% at 8 x 4) and, with Liger's
    loss, ao_offload does too (24.3%; benchmarks/results/*-h100-big-model calls 5-7)."""
    dp = _dp_size(s, cfg, d)
    m, _ = _auto_micro(arch, cfg, s, precision, gpus_per_node, dp, lambda sp: _fits(sp, gpu_memory, host_ram, nvme_free)[0],
                       "cuda", max_search, eval_blocks)
    s_micro, s_accum, _ = with_micro_batch(cfg, max(1, m)).resolve_batch(dp)
    return s_micro, s_accum


# The optimizer options tried, in order, when nothing fits with exact AdamW: each drops more exactness for memory
# (8-bit moments and the step in backward: 16 -> 6 B/param for dp; then bf16 weights: -> 4 B/param).
BEYOND_EXACT = (
    {"optimizer": "adamw8bit", "optimizer_in_backward": True},
    {"optimizer": "adamw8bit", "optimizer_in_backward": True, "master_weights": "bf16"},
)


def _beyond_exact(arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, gpu_memory: float, host_ram: float | None,
                  nvme_free: float | None, ds_est, max_search: int) -> tuple[str, str, StrategyPlan, RunConfig] | None:
    """(strategy, flags, prediction, the run's config with them) of the first BEYOND_EXACT option that fits, on one GPU (dp: the step in backward
    needs one rank with DDP), for a run that asked for exact AdamW. The step in backward cannot accumulate, so the
    micro batch is the whole per-GPU batch: the given global batch when it fits, else the largest that does."""
    if gpus_per_node * cfg.nodes != 1 or cfg.optimizer != "adamw" or cfg.optimizer_in_backward or precision != "bf16":
        return None
    strategy = find(engine="ddp")  # the one-GPU engine that takes every option below (DDP's own reduce needs one rank)
    micro, accum, _ = cfg.resolve_batch(1)
    for option in BEYOND_EXACT:
        c = cfg.model_copy(update={**option, "max_grad_norm": None, "micro_batch": 1, "grad_accum": 1, "global_batch": None})
        if not spec(strategy).supports_bf16_master and c.master_weights == "bf16":
            continue
        largest = _largest_micro(strategy, arch, c, 1, precision, gpus_per_node, gpu_memory, ds_est, min(max_search, micro * accum))
        if largest < 1:
            continue
        sp = _strategy_plan(strategy, arch, c, largest, 1, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing, ds_est)
        sp.fits, sp.why = _fits(sp, gpu_memory, host_ram, nvme_free)
        if not sp.fits:
            continue
        sp.headroom = _usable(gpu_memory) - sp.gpu_peak * RESERVED_OVER_ALLOCATED
        sp.max_micro_batch = largest
        flags = " ".join([f"--strategy {strategy} --optimizer adamw8bit --optimizer-in-backward"]
                         + (["--master-weights bf16"] if c.master_weights == "bf16" else [])
                         + [f"--micro-batch {largest} --grad-accum 1 --set max_grad_norm=null"])
        return strategy, flags, sp, c.model_copy(update={"micro_batch": largest})
    return None


def _auto_micro(arch: Arch, cfg: RunConfig, strategy: str, precision: str, gpus_per_node: int, dp: int,
                fits: Callable[[StrategyPlan], bool], device: str, upper: int, eval_blocks: int | None = None) -> tuple[int, str]:
    """Largest allowed micro batch (microbatch.micro_candidates: divisors of a given global batch) whose
    prediction ``fits``, the accumulation following the batch triple; 0 when even the smallest does not."""
    ds_est = deepspeed_estimates(arch, gpus_per_node, cfg.nodes)
    cands = micro_candidates(cfg, dp, upper)

    def ok(i: int) -> bool:
        c = with_micro_batch(cfg, cands[i])
        m, a, _ = c.resolve_batch(dp)
        return fits(_strategy_plan(strategy, arch, c, m, a, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing, ds_est, device,
                                   eval_blocks=eval_blocks))

    if cfg.global_batch is not None:
        # The accumulation falls as the micro batch grows, and at 1 the accumulation buffers go (dp's gradients at the
        # start of backward, ao_offload's fp32 gradients: 26 GiB for bloom-7b1), so the peak is not monotone in the
        # micro batch: the whole per-rank batch can fit where half of it with accumulation does not. Few candidates
        # (the divisors): try them from the largest down.
        lo = next((i for i in reversed(range(len(cands))) if ok(i)), -1)
    else:
        lo = largest_that_fits(len(cands), ok)  # fixed accumulation: predicted peaks grow with the micro batch
    if lo < 0:
        return 0, f"not even micro batch 1 is predicted to fit {strategy}"
    return cands[lo], f"the largest predicted to fit {strategy}"


def auto_micro_batch(cfg: RunConfig, *, device_type: str, nproc: int, dp: int, cpu_budget: float | None = None,
                     gpu_memory_gb: float | None = None) -> tuple[int, str]:
    """Where `--micro-batch auto` starts: the largest micro batch predicted to fit ``cfg.strategy``.

    GPU: the detected (or given) GPU memory, with the CUDA context and fragmentation allowance of
    ``fits``. CPU: the whole run's predicted host memory (``cpu_run_bytes``) within ``cpu_budget`` bytes,
    at most microbatch.CPU_MAX_MICRO."""
    arch = _arch(cfg)
    run_cfg = cfg.model_copy(update={"gpus": nproc})
    if device_type == "cpu":
        precision = resolve_precision(cfg.precision, "cpu").name
        if cpu_budget is None:
            raise UserError("a CPU plan needs a host-RAM budget", "set cpu_memory_budget_gb")
        micro, _ = _auto_micro(arch, run_cfg, cfg.strategy, precision, nproc, dp,
                               lambda sp: cpu_run_bytes(sp, nproc, reuse_heap=False) <= cpu_budget, "cpu", CPU_MAX_MICRO)
        return micro, f"the largest predicted within the {cpu_budget / GiB:.1f} GiB host-RAM budget, at most {CPU_MAX_MICRO} on CPU"
    precision = cfg.precision if cfg.precision != "auto" else "bf16"
    if gpu_memory_gb is not None:
        gpu_memory = gpu_memory_gb * GiB
    else:
        gpu_memory = _detect_gpu_memory("cuda")
        if gpu_memory is None:
            raise UserError("no CUDA GPU visible to read its memory from", "pass --device cpu")
    micro, _ = _auto_micro(arch, run_cfg, cfg.strategy, precision, nproc, dp,
                           lambda sp: sp.gpu_peak * RESERVED_OVER_ALLOCATED <= _usable(gpu_memory), "cuda", MAX_MICRO)
    return micro, f"the largest predicted to fit {cfg.strategy} in {gpu_memory / GiB:.1f} GiB per GPU"


def predict_cpu_run(cfg: RunConfig, nproc: int, reuse_heap: bool) -> tuple[StrategyPlan, float]:
    """A CPU run of ``cfg`` (integer micro batch, its own precision) on ``nproc`` ranks: the per-rank
    StrategyPlan with CPU activations, and the whole run's host memory (``cpu_run_bytes``) with the heap kept for
    reuse or glibc's default (``reuse_heap``)."""
    precision = resolve_precision(cfg.precision, "cpu").name
    arch = _arch(cfg)
    world = nproc * cfg.nodes
    micro, accum, _ = cfg.resolve_batch(_dp_size(cfg.strategy, cfg, world))
    sp = _strategy_plan(cfg.strategy, arch, cfg, micro, accum, precision, nproc, cfg.nodes, cfg.gradient_checkpointing,
                        deepspeed_estimates(arch, nproc, cfg.nodes), device="cpu")
    return sp, cpu_run_bytes(sp, nproc, reuse_heap)


def _largest_micro(strategy: str, arch: Arch, cfg: RunConfig, accum: int, precision: str, gpus_per_node: int,
                   gpu_memory: float, ds_est, max_search: int) -> int:
    """Largest micro batch up to ``max_search`` whose predicted GPU need fits (peak is increasing in the micro batch): 0 if none."""
    def ok(i: int) -> bool:  # index i: micro batch i + 1
        sp = _strategy_plan(strategy, arch, cfg, i + 1, accum, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing, ds_est)
        return sp.gpu_peak * RESERVED_OVER_ALLOCATED <= _usable(gpu_memory)

    return largest_that_fits(max_search, ok) + 1


def _recommend(out: dict[str, StrategyPlan], arch: Arch, cfg: RunConfig, gpus_per_node: int) -> tuple[str | None, str, str | None]:
    order = [s for s in speed_order() if s in out]
    fitting = [s for s in order if out[s].fits]
    if fitting:
        best = fitting[0]
        faster = [f"{s}: {limiting_memory(out[s])}" for s in order[: order.index(best)]]
        measured = "measured" if spec(best).speed_measured else "placed by reasoning, not measured"
        why_not = f"; faster ones do not fit ({', '.join(faster)})" if faster else ""
        reason = f"{best} is the fastest strategy that fits GPU and host memory (speed order: one H100, benchmarks/RESULTS.md; {measured}){why_not}"
        nxt = fitting[1] if len(fitting) > 1 else None
        return best, reason, nxt
    # nothing fits: what would
    hints = []
    best_micro = max(out.values(), key=lambda sp: sp.max_micro_batch)
    if best_micro.max_micro_batch > 0:
        hints.append(f"--micro-batch {best_micro.max_micro_batch} with {best_micro.strategy} (raise --grad-accum to keep the global batch)")
    if not cfg.gradient_checkpointing:
        hints.append("--gradient-checkpointing")
    # the strategies that shard every model state across the GPUs and keep them there (zero3, fsdp)
    everything = {"params", "grads", "optimizer"}
    sharded = min((sp for s, sp in out.items() if spec(s).sharded == everything and not spec(s).offloads),
                  key=lambda sp: sp.gpu_peak, default=None)
    if sharded is not None:
        hints.append(f"more GPUs: ZeRO-3/FSDP shard the {sharded.model_state_bytes_per_param:.1f} B/param of model states")
    host_bound = [s for s, sp in out.items() if limiting_memory(sp) == "host RAM"]
    if host_bound:
        hints.append(f"more host RAM or --no-pin-memory for {', '.join(host_bound)}")
    return None, "no strategy fits in the GPU and host memory given", "; or ".join(hints) or None


def limiting_memory(sp: StrategyPlan) -> str:
    """Which memory a strategy that does not fit runs out of (``_fits``'s reason)."""
    if sp.why.startswith("CPU needs"):
        return "host RAM"
    return "NVMe" if sp.why.startswith("NVMe") else "GPU"


# Predicted vs measured, documented (not fitted): tests/test_plan.py::test_h100_foundation_errors, against
# tests/data/h100_foundation_peaks.json (test data: the library does not use it).


__all__ = ["Plan", "StrategyPlan", "Arch", "Activations", "plan", "activation_bytes", "arch_from_hf_config",
           "paper_bytes_per_param", "model_state_bytes_per_param", "deepspeed_estimates", "SPEED_ORDER"]
