"""One strategy's prediction (``strategy_plan``): what its engine holds (its memory model, strategies/memory/, asked
through the strategy's spec) composed with the activations of one micro-batch (memory.py) at each moment of a step
(step.py), and its host buffers (host.py). planner.py's docstring says what is counted and from which sources.

``device='cpu'`` predicts a CPU run's allocations the same way; ``predict_cpu_run`` adds the whole run's host memory.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from typing import Any

from ..config import RunConfig
from ..layout import data_parallel_size
from ..training.loss import resolve_loss_kernel
from ..strategies.memory import LayerBytes, NotApplicable, Run, memory_model
from ..specs.registry import spec
from .memory import (
    CUDA_CONTEXT_BYTES,
    Activations,
    Arch,
    StrategyPlan,
    activation_bytes,
    embed_bytes,
    final_bytes,
    input_grad_backward_bytes,
    layer_backward_bytes,
    weight_grad_input_bytes,
)
from . import adapters as adapter_memory
from . import arch as architecture
from .host import cpu_run_bytes, host_plan
from .step import step_plan
from ..training.compiling import scope
from ..training.optim import autocasts
from ..runtime.resolved import resolve_precision


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


def dp_size(strategy: str, cfg: RunConfig, world: int) -> int:
    """Ranks that see different data (the batch triple's world): all but a pipeline's stages. Not refused here: the
    pipeline row's shape is (plan_pipeline.pipeline_layout), so that a full plan can leave it out."""
    return data_parallel_size(cfg, world, strategy)


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


def strategy_plan(strategy: str, arch: Arch, cfg: RunConfig, micro: int, accum: int, precision: str,
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
    per_block = (model.graphs_per_block(s, cfg, gpus_per_node * nodes)  # one compiled graph per block
                 or scope(cfg, strategy=strategy) == "blocks")
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
    cpu_total, cpu_detail, nvme, cpu_cached = host_plan(run if ad is None else replace(run, arch=adapter_memory.trainable_arch(arch, ad)), model)
    paper, est = model.paper_bytes_per_param(s, run.world), model.estimate(run) or {}
    return StrategyPlan(
        strategy=strategy, gpu={**gpu.parts, "overhead (not in allocated)": float(CUDA_CONTEXT_BYTES)}, gpu_peak=gpu.peak,
        peak_moment=gpu.moment, cpu_per_node=cpu_total, cpu_detail=cpu_detail, nvme_per_node=nvme, cpu_per_node_cached=cpu_cached,
        model_state_bytes_per_param=gpu.states_per_param, paper_bytes_per_param=None if paper is None else float(paper),
        deepspeed_gpu=est.get("gpu"), deepspeed_cpu=est.get("cpu"), notes=gpu.notes, micro_batch=micro, grad_accum=accum,
        stages=gpu.gpus, moments=gpu.moments,
    )


def predict_cpu_run(cfg: RunConfig, nproc: int, reuse_heap: bool) -> tuple[StrategyPlan, float]:
    """A CPU run of ``cfg`` (integer micro batch, its own precision) on ``nproc`` ranks: the per-rank
    StrategyPlan with CPU activations, and the whole run's host memory (``cpu_run_bytes``) with the heap kept for
    reuse or glibc's default (``reuse_heap``)."""
    precision = resolve_precision(cfg.precision, "cpu").name
    arch = architecture.read_arch(cfg)
    world = nproc * cfg.nodes
    micro, accum, _ = cfg.resolve_batch(dp_size(cfg.strategy, cfg, world))
    sp = strategy_plan(cfg.strategy, arch, cfg, micro, accum, precision, nproc, cfg.nodes, cfg.gradient_checkpointing, device="cpu")
    return sp, cpu_run_bytes(sp, nproc, reuse_heap)
