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
  copies of the units being computed) and the buffers alive at each moment of a step. This module names no engine: it
  counts the architecture and the activations and composes them with those moments (step.py; a pipeline plans each of
  its GPUs itself). Whether the layers compute under autocast is the run's one decision (training.optim.autocasts).
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
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any, Callable

import torch

from ..config import RunConfig
from ..errors import UserError
from ..layout import data_parallel_size, model_family
from ..training.loss import resolve_loss_kernel
from ..strategies.memory import LayerBytes, NotApplicable, Run, memory_model
from ..specs.registry import all_specs, find, names, spec, speed_order
from .memory import (
    CUDA_CONTEXT_BYTES,
    HOST_HEADROOM,
    RESERVED_OVER_ALLOCATED,
    Activations,
    Arch,
    GiB,
    StrategyPlan,
    activation_bytes,
    compiled_layers_modelled,
    embed_bytes,
    final_bytes,
    host_fits,
    input_grad_backward_bytes,
    layer_backward_bytes,
    weight_grad_input_bytes,
)
from .microbatch import CPU_MAX_MICRO, MAX_MICRO, check_auto_batch, largest_that_fits, micro_candidates, with_micro_batch
from . import adapters as adapter_memory
from .host import cpu_run_bytes, host_plan
from .step import eight_bit_state_bytes, eight_bit_warmup_bytes, eval_loss_bytes, step_plan
from ..strategies.deepspeed_config import sized_buckets, zero3_leaf_classes
from ..training.compiling import scope
from ..training.optim import arithmetic, autocasts
from ..runtime.resolved import resolve_precision

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
# Each strategy's rank is its spec's speed_rank (specs/); these are read from there.
SPEED_ORDER = speed_order()
MEASURED_SPEED = {s.name for s in all_specs() if s.speed_measured}


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
    if dropout is not None:  # shardlab's --dropout overrides every probability (training.models.apply_dropout)
        drops = (dropout, dropout, dropout if family == "gpt2" else 0.0)
    return Arch(
        model=name, family=family, n_params=n, largest_layer_params=largest_layer, block_params=block_params,
        root_params=n - in_blocks, persistent_params=persistent, hidden=hidden, layers=layers, heads=heads,
        kv_heads=kv_heads, ffn=ffn, vocab=int(c.vocab_size), attn_impl=attn_impl,
        attn_dropout=float(drops[0]), resid_dropout=float(drops[1]), embd_dropout=float(drops[2]),
        pipeline_parts=_pipeline_parts(model), param_sizes=tuple(sizes), leaf_classes=tuple(zero3_leaf_classes(model)),
        linears=_linears(model, blocks),
    )


def _linears(model: Any, blocks: list[Any]) -> tuple[tuple[str, int, int, int], ...]:
    """(name, in, out, block index or -1) of every linear layer but the head, as QLoRA quantises them
    (training.adapters.quantised_layers: peft's 'all-linear' is the same set)."""
    from transformers.pytorch_utils import Conv1D

    from ..training.adapters import quantised_layers

    where = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    out = []
    for name in quantised_layers(model):
        m = model.get_submodule(name)
        rows, cols = m.weight.shape
        i, o = (rows, cols) if isinstance(m, Conv1D) else (cols, rows)
        out.append((name, int(i), int(o), where.get(id(m), -1)))
    return tuple(out)


def _planned_attn(cfg: RunConfig, hf_config: Any) -> str:
    """The attention implementation a CUDA run would get (flash and SDPA keep the same tensors)."""
    from ..training.models import causal_lm_class, supports_attention

    cls = causal_lm_class(hf_config)
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    return "sdpa" if supports_attention(cls, "sdpa") else "eager"


# --------------------------------------------------------------------------------------------------
# One strategy's prediction: what its engine holds (its memory model, strategies/memory/), composed with the activations


def paper_bytes_per_param(strategy: str, d: int) -> Fraction | None:
    """ZeRO paper (Rajbhandari et al. 2020, Fig. 1, K = 12 for mixed-precision Adam): bytes per parameter per GPU,
    baseline 16, P_os 4 + 12/N, P_os+g 2 + 14/N, P_os+g+p 16/N, of the stage the strategy matches; None where the
    figure has none (offload, a pipeline)."""
    s = spec(strategy)
    return memory_model(s).paper_bytes_per_param(s, d)


def model_state_bytes_per_param(strategy: str, d: int, precision: str = "bf16") -> Fraction:
    """shardlab's parameters + gradients + optimizer states per GPU, bytes per parameter (exact)."""
    s = spec(strategy)
    return memory_model(s).states(s, d, precision).per_param


def eval_batch_per_rank(cfg: RunConfig, strategy: str, micro: int, accum: int, dp: int, eval_blocks: int | None) -> int:
    """Rows of one eval forward on one rank (loop.trainer._loaders): the eval batch is the micro batch (a whole
    step's micro-batches where the strategy evaluates whole steps), and DistributedSampler gives every rank
    ceil(blocks / ranks) rows (drop_last=False pads). With ``eval_blocks`` unknown (the launcher plans before the data
    is read) a full eval batch: what an eval split of at least ``dp`` batches uses. 0 when there is no eval split."""
    if cfg.dataset.eval_split <= 0 or eval_blocks == 0:
        return 0
    batch = spec(strategy).eval_batch(micro, accum)
    if eval_blocks is None:
        return batch
    return min(batch, math.ceil(eval_blocks / max(1, dp)))


def compute_mode(strategy: str, cfg: RunConfig, precision: str) -> str:
    """How the layers compute, for their activations: 'autocast' over fp32 weights where the run autocasts (the one
    decision: training.optim.autocasts), else 'lp' (16-bit weights: the engine's, or bf16 master weights) or 'fp32'."""
    if autocasts(spec(strategy), cfg, precision):
        return "autocast"
    return "fp32" if precision == "fp32" else "lp"


def _layers(arch: Arch, act: Activations, mode: str, device: str, micro: int, seq: int) -> LayerBytes:
    """One micro-batch's activations per layer, for an engine that places layers itself (the pipeline)."""
    sbh = float(seq * micro * arch.hidden)
    return LayerBytes(saved=act.per_layer, recompute=act.recompute, backward=layer_backward_bytes(arch, mode) * sbh,
                      input_grad_backward=input_grad_backward_bytes(arch, mode) * sbh,
                      weight_grad_inputs=weight_grad_input_bytes(arch, mode) * sbh,
                      embed=embed_bytes(arch, mode, device) * sbh, final=final_bytes(arch, mode, device) * sbh)


def _adapted(s: Any, arch: Arch, cfg: RunConfig, act: Activations, mode: str, micro: int, compiled: bool,
             per_block: bool) -> tuple[Arch, Activations, str, Any]:
    """An adapter run's architecture, activations and compute mode (planning/adapters.py), or NotApplicable where the
    strategy does not train the method (training.adapters.check refuses it there)."""
    p = cfg.peft
    if p.method not in s.adapters:
        raise NotApplicable(f"--peft {p.method} does not run under {s.name}", "use --strategy dp")
    ad = adapter_memory.count_adapters(arch, p.method, p.r, p.target_modules)
    new_mode = adapter_memory.compute_mode(mode, ad)
    arch = replace(arch, autocast_weight_params=adapter_memory.autocast_params(arch, ad, new_mode))
    if new_mode != mode:
        act = activation_bytes(arch, micro, cfg.seq_len, new_mode, "cuda", cfg.gradient_checkpointing,
                               resolve_loss_kernel(cfg.loss_kernel, "cuda"), compiled, per_block)
    act = adapter_memory.activations(act, arch, ad, new_mode, micro, cfg.seq_len, p.dropout, cfg.gradient_checkpointing,
                                     autocast=mode == "autocast")
    return arch, act, new_mode, ad


def _strategy_plan(strategy: str, arch: Arch, cfg: RunConfig, micro: int, accum: int, precision: str,
                   gpus_per_node: int, nodes: int, checkpointing: bool, device: str = "cuda",
                   eval_blocks: int | None = None) -> StrategyPlan:
    """One strategy's prediction. ``device='cpu'`` predicts a CPU run's allocations instead (CPU activation
    layout, torch's AdamW temporaries), which ``shardlab train --device cpu`` records and
    ``--micro-batch auto`` caps by a host-RAM budget. ``eval_blocks``: the eval split's size in blocks, when known
    (``eval_batch_per_rank``)."""
    s = spec(strategy)
    model = memory_model(s)
    mode = compute_mode(strategy, cfg, precision)
    kernel = "hf" if s.own_loss else resolve_loss_kernel(cfg.loss_kernel, device)
    compiled = cfg.compile and s.supports_compile
    per_block = s.graph_breaks_per_block or scope(cfg, strategy=strategy) == "blocks"  # one compiled graph per block
    act = activation_bytes(arch, micro, cfg.seq_len, mode, device, checkpointing, kernel, compiled, per_block)
    ad = None
    if cfg.peft.method:  # a frozen base and trainable adapters (planning/adapters.py)
        arch, act, mode, ad = _adapted(s, arch, cfg, act, mode, micro, compiled, per_block)
    run = Run(s, arch, cfg, micro, accum, precision, gpus_per_node, nodes, checkpointing, device, autocast=mode == "autocast",
              layers=_layers(arch, act, mode, device, micro, cfg.seq_len))
    gpu = model.per_gpu(run)
    if gpu is None:  # every rank runs the same step: its moments, composed here from what the engine holds
        eval_rows = eval_batch_per_rank(cfg, strategy, micro, accum, run.world, eval_blocks)
        held = model.held(run) if ad is None else adapter_memory.held(run, model, ad)
        gpu = step_plan(run, held, model, act, mode, kernel, eval_rows)
    # an adapter run's host buffers are the engine's for the adapters (offloaded optimizer states)
    cpu_total, cpu_detail, nvme = host_plan(run if ad is None else replace(run, arch=adapter_memory.trainable_arch(arch, ad)), model)
    paper, est = model.paper_bytes_per_param(s, run.world), model.estimate(run) or {}
    return StrategyPlan(
        strategy=strategy, gpu={**gpu.parts, "overhead (not in allocated)": float(CUDA_CONTEXT_BYTES)}, gpu_peak=gpu.peak,
        peak_moment=gpu.moment, cpu_per_node=cpu_total, cpu_detail=cpu_detail, nvme_per_node=nvme,
        model_state_bytes_per_param=gpu.states_per_param, paper_bytes_per_param=None if paper is None else float(paper),
        deepspeed_gpu=est.get("gpu"), deepspeed_cpu=est.get("cpu"), notes=gpu.notes, micro_batch=micro, grad_accum=accum,
        stages=gpu.gpus, moments=gpu.moments,
    )


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
    # A full fine-tuning plan's adapter rows ("lora (dp)", "qlora (dp)"): the same run with --peft, beside it
    adapters: dict[str, StrategyPlan] = field(default_factory=dict)

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


@dataclass(frozen=True)
class _Budget:
    """What a plan must fit: memory per GPU, and host RAM and free NVMe per node (None: not given), in bytes."""
    gpu: float
    host: float | None = None
    nvme: float | None = None

    def fits(self, sp: StrategyPlan) -> tuple[bool, str]:
        return _fits(sp, self.gpu, self.host, self.nvme)

    def gpu_fits(self, sp: StrategyPlan) -> bool:
        return sp.gpu_peak * RESERVED_OVER_ALLOCATED <= _usable(self.gpu)


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
    arch = _arch(cfg)  # an unknown model is the first problem to report, before a missing GPU
    budget, source = _budget(cfg, gpu_memory_gb, host_ram_gb, nvme_free_gb)
    gpus_per_node = _gpus_per_node(cfg)
    d = gpus_per_node * cfg.nodes
    precision = cfg.precision if cfg.precision != "auto" else "bf16"  # plan is for GPUs: auto = bf16 (A100/H100)
    plan_notes: list[str] = []
    auto_cfg = cfg if cfg.micro_batch == "auto" else None  # each strategy then gets its own micro batch (_rows)
    if auto_cfg is not None:
        cfg = _auto_header(arch, cfg, precision, gpus_per_node, budget, max_search, eval_blocks, plan_notes)
    micro, accum, _ = cfg.resolve_batch(_dp_size(cfg.strategy, cfg, d))
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
        found = _beyond_exact(arch, cfg, precision, gpus_per_node, budget, max_search)
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


def _budget(cfg: RunConfig, gpu_memory_gb: float | None, host_ram_gb: float | None,
            nvme_free_gb: float | None) -> tuple[_Budget, str]:
    """The memory given, or the GPU's detected (with where its figure came from)."""
    if gpu_memory_gb is not None:
        gpu_memory, source = gpu_memory_gb * GiB, "given"
    else:
        detected = _detect_gpu_memory(cfg.device)
        if detected is None:
            raise UserError("no CUDA GPU visible to read its memory from",
                            "pass --gpu-memory-gb (e.g. 80 for an H100 80GB), or --device cpu to plan a run on this machine's CPU")
        gpu_memory, source = detected, "detected (GPU 0)"
    host = host_ram_gb * GiB if host_ram_gb is not None else None
    nvme = nvme_free_gb * GiB if nvme_free_gb is not None else None
    return _Budget(gpu_memory, host, nvme), source


def _auto_header(arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, budget: _Budget, max_search: int,
                 eval_blocks: int | None, notes: list[str]) -> RunConfig:
    """`--micro-batch auto`: the plan's header is at the configured strategy's largest micro batch predicted to fit the
    GPU; every strategy is planned at its own (_own_auto_micro)."""
    dp_main = _dp_size(cfg.strategy, cfg, gpus_per_node * cfg.nodes)
    check_auto_batch(cfg, dp_main)
    micro_auto, why = _auto_micro(arch, cfg, cfg.strategy, precision, gpus_per_node, dp_main, budget.gpu_fits, "cuda", max_search,
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
          budget: _Budget, strategies: tuple[str, ...] | None, max_search: int, eval_blocks: int | None,
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
            s_micro, s_accum = _own_auto_micro(s, arch, auto_cfg, precision, gpus_per_node, d, budget, max_search, eval_blocks)
        else:
            s_micro, s_accum = batch
        try:
            sp = _strategy_plan(s, arch, cfg, s_micro, s_accum, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing,
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


def _adapter_rows(arch: Arch, cfg: RunConfig, batch: tuple[int, int], precision: str, gpus_per_node: int, budget: _Budget,
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
        sp = _strategy_plan(s, arch, c, *batch, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing)
        _judge(sp, s, arch, c, batch[1], precision, gpus_per_node, budget, max_search)
        out[f"{method} ({s})"] = sp
    return out


def _judge(sp: StrategyPlan, s: str, arch: Arch, cfg: RunConfig, accum: int, precision: str, gpus_per_node: int,
           budget: _Budget, max_search: int) -> None:
    """A plan row's verdict against the budget: whether it fits, its headroom and its largest micro batch."""
    sp.fits, sp.why = budget.fits(sp)
    sp.headroom = _usable(budget.gpu) - sp.gpu_peak * RESERVED_OVER_ALLOCATED
    sp.max_micro_batch = _largest_micro(s, arch, cfg, accum, precision, gpus_per_node, budget, max_search)


def _own_auto_micro(s: str, arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, d: int, budget: _Budget,
                    max_search: int, eval_blocks: int | None) -> tuple[int, int]:
    """(micro, accum) for strategy ``s`` under `--micro-batch auto`: its largest micro batch that fits GPU and host memory
    (1 when none does, so the table still says why not). One micro batch for every strategy would plan them all at the
    configured strategy's: for bloom-7b1 on one 80 GB GPU and a global batch of 32, dp's (none fits, so 1 x accum 32),
    where fsdp_offload fits all 32 without accumulation (14.4% MFU measured at 32 x 1, 10.8% at 8 x 4) and, with Liger's
    loss, ao_offload does too (24.3%; benchmarks/results/*-h100-big-model calls 5-7)."""
    dp = _dp_size(s, cfg, d)
    m, _ = _auto_micro(arch, cfg, s, precision, gpus_per_node, dp, lambda sp: budget.fits(sp)[0], "cuda", max_search, eval_blocks)
    s_micro, s_accum, _ = with_micro_batch(cfg, max(1, m)).resolve_batch(dp)
    return s_micro, s_accum


# The optimizer options tried, in order, when nothing fits with exact AdamW: each drops more exactness for memory
# (8-bit moments and the step in backward: 16 -> 6 B/param for dp; then bf16 weights: -> 4 B/param).
BEYOND_EXACT = (
    {"optimizer": "adamw8bit", "optimizer_in_backward": True},
    {"optimizer": "adamw8bit", "optimizer_in_backward": True, "master_weights": "bf16"},
)


def _beyond_exact(arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, budget: _Budget,
                  max_search: int) -> tuple[str, str, StrategyPlan, RunConfig] | None:
    """(strategy, flags, prediction, the run's config with them) of the first BEYOND_EXACT option that fits, on one GPU, for
    a run that asked for exact AdamW. The step in backward cannot accumulate, so the micro batch is the whole per-GPU
    batch: the given global batch when it fits, else the largest that does."""
    if gpus_per_node * cfg.nodes != 1 or cfg.optimizer != "adamw" or cfg.optimizer_in_backward or precision != "bf16":
        return None
    # the first strategy that takes every option below (dp: on one rank, DDP's own reduce is no obstacle)
    strategy = find(supports_8bit=True, supports_in_backward=True, supports_bf16_master=True)
    micro, accum, _ = cfg.resolve_batch(1)
    for option in BEYOND_EXACT:
        c = cfg.model_copy(update={**option, "max_grad_norm": None, "micro_batch": 1, "grad_accum": 1, "global_batch": None})
        largest = _largest_micro(strategy, arch, c, 1, precision, gpus_per_node, budget, min(max_search, micro * accum))
        if largest < 1:
            continue
        sp = _strategy_plan(strategy, arch, c, largest, 1, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing)
        sp.fits, sp.why = budget.fits(sp)
        if not sp.fits:
            continue
        sp.headroom = _usable(budget.gpu) - sp.gpu_peak * RESERVED_OVER_ALLOCATED
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
    cands = micro_candidates(cfg, dp, upper)

    def ok(i: int) -> bool:
        c = with_micro_batch(cfg, cands[i])
        m, a, _ = c.resolve_batch(dp)
        return fits(_strategy_plan(strategy, arch, c, m, a, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing, device,
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
    micro, _ = _auto_micro(arch, run_cfg, cfg.strategy, precision, nproc, dp, _Budget(gpu_memory).gpu_fits, "cuda", MAX_MICRO)
    return micro, f"the largest predicted to fit {cfg.strategy} in {gpu_memory / GiB:.1f} GiB per GPU"


def predict_cpu_run(cfg: RunConfig, nproc: int, reuse_heap: bool) -> tuple[StrategyPlan, float]:
    """A CPU run of ``cfg`` (integer micro batch, its own precision) on ``nproc`` ranks: the per-rank
    StrategyPlan with CPU activations, and the whole run's host memory (``cpu_run_bytes``) with the heap kept for
    reuse or glibc's default (``reuse_heap``)."""
    precision = resolve_precision(cfg.precision, "cpu").name
    arch = _arch(cfg)
    world = nproc * cfg.nodes
    micro, accum, _ = cfg.resolve_batch(_dp_size(cfg.strategy, cfg, world))
    sp = _strategy_plan(cfg.strategy, arch, cfg, micro, accum, precision, nproc, cfg.nodes, cfg.gradient_checkpointing, device="cpu")
    return sp, cpu_run_bytes(sp, nproc, reuse_heap)


def _largest_micro(strategy: str, arch: Arch, cfg: RunConfig, accum: int, precision: str, gpus_per_node: int,
                   budget: _Budget, max_search: int) -> int:
    """Largest micro batch up to ``max_search`` whose predicted GPU need fits (peak is increasing in the micro batch): 0 if none."""
    def ok(i: int) -> bool:  # index i: micro batch i + 1
        return budget.gpu_fits(_strategy_plan(strategy, arch, cfg, i + 1, accum, precision, gpus_per_node, cfg.nodes,
                                              cfg.gradient_checkpointing))

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
           "paper_bytes_per_param", "model_state_bytes_per_param", "SPEED_ORDER",
           # the 8-bit step's and the eval loss' bytes (step.py), where callers have always found them
           "eight_bit_state_bytes", "eight_bit_warmup_bytes", "eval_loss_bytes"]
