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
* What each engine holds, on the GPU and the host, is its own memory model's answer (strategies/memory/, named by
  its spec): the mixed-precision recipe it *actually* uses in shardlab (dp = torch autocast over fp32 weights,
  4 + 4 + 8 B/param; DeepSpeed bf16/fp16 = 16-bit params (2) + 16-bit grads (2) + fp32 master, m, v (12), sharded per
  stage; FSDP2 with ``MixedPrecisionPolicy`` = fp32 sharded params, grads and AdamW states plus 16-bit unsharded
  copies of the units being computed) and the buffers alive at each moment of a step. The planner names no engine:
  it counts the architecture (arch.py) and the activations and composes them with those moments (strategy_plan.py,
  step.py; a pipeline plans each of its GPUs itself). Whether the layers compute under autocast is the run's one
  decision (training.optim.autocasts).
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
* The peak is the largest of the moments of a step (step.py): the start of backward (all saved activations + the
  loss' logits peak above + what the engine holds then: buckets, gathered parameters, gradients kept while
  accumulating; with checkpointing no layer is recomputed yet), the LM head's backward, a checkpointed layer's
  backward (its recomputation and backward temporaries, the logits freed), the optimizer step (all gradients, step
  temporaries, no activations), the engine's own moments once the activations are gone, and an eval forward (shardlab
  evaluates before the first step, at epoch ends and after the last: the logits at the eval batch each rank gets,
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
from typing import Any

import torch

from ..config import RunConfig
from ..errors import UserError
from ..training.loss import resolve_loss_kernel
from ..strategies.memory import NotApplicable, memory_model
from ..specs.registry import all_specs, names, spec, speed_measured, speed_order
from .memory import RESERVED_OVER_ALLOCATED, Activations, Arch, StrategyPlan, activation_bytes
from .microbatch import check_auto_batch
from . import arch as architecture
from .arch import compile_is_modelled
from .budget import Budget, budget_for, limiting_memory, usable
from .micro_search import auto_micro, beyond_exact, largest_micro, own_auto_micro
from .step import eight_bit_state_bytes, eight_bit_warmup_bytes, eval_loss_bytes
from .strategy_plan import dp_size, strategy_plan
from ..training.optim import arithmetic

# Speed order measured on one H100 (benchmarks/results/h100-foundation.md, tok/s at gpt2-medium,
# seq 1024, micro 8, bf16): dp 57.2k > zero2 48.9k > fsdp 46.1k > zero2_offload 22.6k > zero3 21.0k.
# zero3 and zero2_offload are within noise of each other there (the file quotes ±10% for DeepSpeed);
# zero3 is ranked first because it keeps everything on the GPU and scales with more GPUs.
# The offloads for a model that does not fit, side by side on one H100 (benchmarks/results/*-h100-big-model,
# calls 6-7: bloom-7b1, global batch 32, checkpointing, exact AdamW): ao_offload 24.3% MFU > fsdp_offload 14.4% >
# zero3_offload 9.5% (--offload-ratio 0.7; 18.3% fully offloaded on a larger host); zero2_offload 24.8% on that larger
# host, so ao_offload stays after it. zero0/zero1/zero1_offload/infinity were not measured: placed by
# reasoning (zero0, zero1 ~ zero2 communication; offloads slower than their GPU versions; NVMe slowest).
# On several GPUs of a node the order changes: the strategies that shard the optimizer run their share of its step
# while dp runs all of it on every GPU beside its all-reduce. Measured on two H200s (benchmarks/results/
# *-h200x2-scaling-bars, eager, micro 8 per GPU, medians of 3 for llama-3.2-1b, 1-2 runs for gpt2-large), tok/s:
# zero2 92.1k / 107.8k, zero1 92.4k / 107.2k, fsdp 92.8k / 59.6k, zero3 88.7k / 87.6k, dp 87.1k / 79.2k. zero2 before
# zero1 (the same speed, less memory), fsdp before zero3 on llama-3.2-1b and bloom-7b1 (47.7% against 45.4% MFU
# compiled), although gpt2-large's fsdp ran at 59.6k there (0.88 of two GPUs before): one H200 since found its per-block
# path host-bound, at one-unit speed with 3 blocks a unit (*-h200-fsdp-units; strategies/fsdp.blocks_per_unit). zero0
# placed after dp by reasoning; the offloads keep their one-GPU order after these.
# Each strategy's rank is its spec's speed_rank and multi_gpu_speed_rank (specs/); these are read from there.
SPEED_ORDER = speed_order()
MEASURED_SPEED = {s.name for s in all_specs() if s.speed_measured}


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
    # When no strategy fits with exact AdamW: the lightest-touch optimizer option that does (``micro_search.beyond_exact``),
    # as the flags to add, and its prediction. None when something exact fits or the run already asks for such options.
    recommended_flags: str | None = None
    recommended_plan: StrategyPlan | None = None
    # A full fine-tuning plan's adapter rows ("lora (dp)", "qlora (dp)"): the same run with --peft, beside it
    adapters: dict[str, StrategyPlan] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _gpus_per_node(cfg: RunConfig) -> int:
    if cfg.gpus is not None:
        return cfg.gpus
    try:
        return max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)
    except Exception:
        return 1


def plan(cfg: RunConfig, *, gpu_memory_gb: float | None = None, host_ram_gb: float | None = None,
         nvme_free_gb: float | None = None, strategies: tuple[str, ...] | None = None, max_search: int = 4096,
         eval_blocks: int | None = None) -> Plan:
    """Predict memory for every strategy of ``cfg`` (its model, seq_len, micro batch, GPUs, precision).

    ``gpu_memory_gb``: per-GPU memory in GiB (2**30 bytes; GPU memory is built in binary units: an
    "80GB" H100 has 80 GiB of HBM, of which torch reports ~79.1 GiB), detected with torch.cuda when
    omitted, required when no GPU is visible. ``host_ram_gb`` / ``nvme_free_gb``: per node, GiB too.
    ``micro_batch: auto`` is planned at the largest micro batch predicted to fit ``cfg.strategy``.
    ``eval_blocks``: the eval split's size in blocks where known (the eval forward's batch per rank,
    ``strategy_plan.eval_batch_per_rank``); unknown, a full eval batch is planned.
    """
    for name, value in (("--gpu-memory-gb", gpu_memory_gb), ("--host-ram-gb", host_ram_gb), ("--nvme-free-gb", nvme_free_gb)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UserError(f"{name} must be a positive number of GB, got {value}", f"pass e.g. {name} 80")
    for s in strategies or ():
        if s not in names():
            raise UserError(f"unknown strategy {s!r}", f"choose from {', '.join(names())}")
    arch = architecture.read_arch(cfg)  # an unknown model is the first problem to report, before a missing GPU
    budget, source = budget_for(cfg, gpu_memory_gb, host_ram_gb, nvme_free_gb)
    gpus_per_node = _gpus_per_node(cfg)
    d = gpus_per_node * cfg.nodes
    precision = cfg.precision if cfg.precision != "auto" else "bf16"  # plan is for GPUs: auto = bf16 (A100/H100)
    plan_notes: list[str] = []
    auto_cfg = cfg if cfg.micro_batch == "auto" else None  # each strategy then gets its own micro batch (_rows)
    if auto_cfg is not None:
        cfg = _auto_header(arch, cfg, precision, gpus_per_node, budget, max_search, eval_blocks, plan_notes)
    micro, accum, _ = cfg.resolve_batch(dp_size(cfg.strategy, cfg, d))
    compile_modelled = compile_is_modelled(cfg, arch)
    plan_notes += _plan_notes(cfg, arch, compile_modelled)
    out = _rows(arch, cfg, auto_cfg, (micro, accum), precision, gpus_per_node, budget, strategies, max_search, eval_blocks,
                plan_notes)
    rec, reason, nxt = _recommend(out, arch, cfg, gpus_per_node)
    flags, option = None, None
    adapter_rows = _adapter_rows(arch, cfg, (micro, accum), precision, gpus_per_node, budget, max_search) if not strategies else {}
    if rec is None and any(sp.fits for sp in adapter_rows.values()):
        fit = [name for name, sp in adapter_rows.items() if sp.fits]
        reason = f"{reason}; only an adapter fits: {', '.join(fit)} (--peft trains adapters on a frozen base, not the model)"
    if rec is None and not strategies:
        found = beyond_exact(arch, cfg, precision, gpus_per_node, budget, max_search)
        if found is not None:
            rec, flags, option, option_cfg = found
            reason = f"no strategy fits with exact fp32 AdamW ({reason}); {rec} fits with {arithmetic(option_cfg)}"
            nxt = None
    return Plan(
        model=cfg.model, family=arch.family, n_params=arch.n_params, largest_layer_params=arch.largest_layer_params,
        seq_len=cfg.seq_len, micro_batch=micro, grad_accum=accum, precision=precision,
        gradient_checkpointing=cfg.gradient_checkpointing, attn_implementation=arch.attn_impl,
        gpus_per_node=gpus_per_node, nodes=cfg.nodes, gpu_memory=budget.gpu, gpu_memory_source=source,
        host_ram=budget.host, nvme_free=budget.nvme, strategies=out, recommendation=rec, reason=reason, next_option=nxt,
        compile=cfg.compile, compile_modelled=compile_modelled, notes=plan_notes, micro_auto=auto_cfg is not None,
        recommended_flags=flags, recommended_plan=option, adapters=adapter_rows,
    )


def _auto_header(arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, budget: Budget, max_search: int,
                 eval_blocks: int | None, notes: list[str]) -> RunConfig:
    """`--micro-batch auto`: the plan's header is at the configured strategy's largest micro batch predicted to fit the
    GPU; every strategy is planned at its own (micro_search.own_auto_micro)."""
    dp_main = dp_size(cfg.strategy, cfg, gpus_per_node * cfg.nodes)
    check_auto_batch(cfg, dp_main)
    micro_auto, why = auto_micro(arch, cfg, cfg.strategy, precision, gpus_per_node, dp_main, budget.gpu_fits, "cuda", max_search,
                                 eval_blocks)
    cfg = cfg.model_copy(update={"micro_batch": max(1, micro_auto)})
    notes.append(f"micro batch 'auto': each strategy is planned at its own largest micro batch predicted to fit GPU and "
                 f"host memory (column 'micro x accum'; {cfg.strategy}: {cfg.micro_batch}, {why}); "
                 "`shardlab train --micro-batch auto` confirms its strategy's with short trial runs")
    return cfg


def _plan_notes(cfg: RunConfig, arch: Arch, compile_modelled: bool | None) -> list[str]:
    """The caveats of a plan of ``cfg``: how --compile, CUDA graphs, the 8-bit optimizer and the loss are counted."""
    notes = []
    if compile_modelled:
        notes.append(
            "--compile: the decoder layers are counted as inductor saves them (fewer, 16-bit tensors: planning/memory.py "
            "_compiled_layer_bytes; gpt2-medium dp micro 16 on an H100: 22.1 GiB planned, 22.2 measured; with pad_head=false "
            "23.7 measured, not modelled), the embedding and the loss as in eager runs")
    elif cfg.compile:
        notes.append(
            f"--compile is NOT modelled for the {arch.family} family (its compiled layers were never traced): these are "
            "eager-mode predictions, an upper bound; inductor recomputes cheap ops instead of saving them")
    if cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        notes.append(f"compile_mode {cfg.compile_mode!r} captures CUDA graphs, whose static memory pools are not modelled: "
                     "the GPU peak can be higher than planned")
    if cfg.optimizer == "adamw8bit":
        notes.append("--optimizer adamw8bit: torchao compiles its step in the process (counted on the host); shardlab "
                     "compiles and autotunes it before training, beside the weights alone, so inductor's autotuner "
                     "clones on the GPU and copies nothing to the host")
    if resolve_loss_kernel(cfg.loss_kernel, "cuda") == "compiled":
        notes.append("the loss is shardlab's compiled kernel (loss_kernel): 4 bytes per logit at the start of backward "
                     "in 16-bit runs, against 12 for the model's own loss (--set loss_kernel=hf)")
    elif cfg.loss_kernel == "liger":
        notes.append("the loss is Liger-Kernel's fused linear cross-entropy (loss_kernel=liger): no logits; the head "
                     "weight's gradient is held from forward to backward instead")
    return notes


def _rows(arch: Arch, cfg: RunConfig, auto_cfg: RunConfig | None, batch: tuple[int, int], precision: str, gpus_per_node: int,
          budget: Budget, strategies: tuple[str, ...] | None, max_search: int, eval_blocks: int | None,
          notes: list[str]) -> dict[str, StrategyPlan]:
    """Every strategy's prediction (those asked, else all that can run here: what cannot is a note), each at the batch
    its engine runs (its own under `--micro-batch auto`), with whether it fits and its largest micro batch."""
    d = gpus_per_node * cfg.nodes
    user_json = ("of a user DeepSpeed JSON plan reads only data_types.grad_accum_dtype: buckets are shardlab's "
                 "strategy_options") if cfg.deepspeed_config else ""
    out: dict[str, StrategyPlan] = {}
    for s in strategies or names():
        if spec(s).single_process and d > 1 and not strategies:  # e.g. torchao's offload (strategies/ao_offload.py)
            notes.append(f"{s} left out: it runs on one GPU only")
            continue
        own = memory_model(spec(s)).batch(cfg.model_copy(update={"strategy": s}), d)  # e.g. a pipeline's micro-batches
        if own is not None:
            s_micro, s_accum = own
        elif auto_cfg is not None:
            s_micro, s_accum = own_auto_micro(s, arch, auto_cfg, precision, gpus_per_node, d, budget, max_search, eval_blocks)
        else:
            s_micro, s_accum = batch
        try:
            sp = strategy_plan(s, arch, cfg, s_micro, s_accum, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing,
                               eval_blocks=eval_blocks)
        except NotApplicable as err:
            if strategies:
                raise
            notes.append(f"{s} left out: {err.message}")
            continue
        _judge(sp, s, arch, cfg, s_accum, precision, gpus_per_node, budget, max_search)
        if user_json:
            sp.notes.append(user_json)
        out[s] = sp
    return out


def _adapter_rows(arch: Arch, cfg: RunConfig, batch: tuple[int, int], precision: str, gpus_per_node: int, budget: Budget,
                  max_search: int) -> dict[str, StrategyPlan]:
    """For a full fine-tuning plan: LoRA and QLoRA (peft's defaults) on the first strategy in speed order that trains
    each, at the plan's batch, with whether they fit."""
    if cfg.peft.method:
        return {}
    out = {}
    for method in ("lora", "qlora"):
        c = cfg.model_copy(update={"peft": cfg.peft.model_copy(update={"method": method})})
        s = next((s for s in speed_order() if method in spec(s).adapters), None)
        if s is None:
            continue
        sp = strategy_plan(s, arch, c, *batch, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing)
        _judge(sp, s, arch, c, batch[1], precision, gpus_per_node, budget, max_search)
        out[f"{method} ({s})"] = sp
    return out


def _judge(sp: StrategyPlan, s: str, arch: Arch, cfg: RunConfig, accum: int, precision: str, gpus_per_node: int,
           budget: Budget, max_search: int) -> None:
    """A plan row's verdict against the budget: whether it fits, its headroom and its largest micro batch."""
    sp.fits, sp.why = budget.fits(sp)
    sp.headroom = usable(budget.gpu) - sp.gpu_peak * RESERVED_OVER_ALLOCATED
    sp.max_micro_batch = largest_micro(s, arch, cfg, accum, precision, gpus_per_node, budget, max_search)


def _recommend(out: dict[str, StrategyPlan], arch: Arch, cfg: RunConfig, gpus_per_node: int) -> tuple[str | None, str, str | None]:
    gpus = gpus_per_node * cfg.nodes
    order = [s for s in speed_order(gpus) if s in out]
    fitting = [s for s in order if out[s].fits]
    if fitting:
        best = fitting[0]
        faster = [f"{s}: {limiting_memory(out[s])}" for s in order[: order.index(best)]]
        measured = "measured" if speed_measured(best, gpus) else "placed by reasoning, not measured"
        why_not = f"; faster ones do not fit ({', '.join(faster)})" if faster else ""
        where = "one H100" if gpus == 1 else "two H200s"
        reason = f"{best} is the fastest strategy that fits GPU and host memory (speed order: {where}, benchmarks/RESULTS.md; {measured}){why_not}"
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


# Predicted vs measured, documented (not fitted): tests/test_plan.py::test_h100_foundation_errors, against
# tests/data/h100_foundation_peaks.json (test data: the library does not use it).


__all__ = ["Plan", "StrategyPlan", "Arch", "Activations", "plan", "activation_bytes", "SPEED_ORDER",
           # the 8-bit step's and the eval loss' bytes (step.py), where callers have always found them
           "eight_bit_state_bytes", "eight_bit_warmup_bytes", "eval_loss_bytes"]
