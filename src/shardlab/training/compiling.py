"""torch.compile of the model: whole, or each decoder block on its own (``compile_scope``).

Whole-model compile (``model``) gives inductor the largest graph; on one GPU it is at parity with the bare compiled
loop (benchmarks/results/*-h100-speed). But a whole graph has one backward, so every gradient appears at
its end, at once. That defeats the strategies whose point is to act on each gradient as it is produced:
- FSDP2 reduce-scatters and reshards per block in hooks around each block's forward and backward; torchtitan
  compiles each TransformerBlock on its own for this reason (its ``apply_compile``);
- ``--optimizer-in-backward`` steps and frees each parameter's gradient in its hook: with one backward graph the
  full set of gradients exists at once, which is the memory the option is there to save;
- ``ao_offload`` (torchao CPUOffloadOptimizer) starts each gradient's device-to-host copy in its hook, overlapped with
  the rest of backward.
``blocks`` compiles each repeated block in place (``nn.Module.compile``): every block has the same code, so dynamo
compiles one graph and reuses it; the module hooks of FSDP2 and the gradient hooks stay outside the compiled code.
Embeddings, final norm and head (a small share of the work) stay eager. ``auto`` picks per strategy (see ``scope``).
The DeepSpeed strategies hand the whole-model case to DeepSpeed's own ``engine.compile`` (strategies/deepspeed_zero.py).

Measured side by side on one H200 (gpt2-medium, micro 16, bf16, 2 runs each;
benchmarks/results/*-h100-speed/call3-h200): fsdp whole model 133.2k tok/s, per block 118.4k (resharding;
154.2k / 113.7k without). So fsdp's ``auto`` stays the whole model; ``blocks`` is the default only where one backward
graph defeats the point of the strategy (ao_offload, --optimizer-in-backward), and anyone can pick either with
``compile_scope``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..specs.registry import spec
from .models import transformer_blocks


def scope(cfg, model: nn.Module | None = None, strategy: str | None = None) -> str:
    """'model' or 'blocks': what --compile compiles in this run (under ``strategy``, else the run's). Under 'auto',
    'blocks' for the strategies whose spec says they act per block or per gradient in hooks (``compile_per_block``)
    and with the optimizer in backward. Given the model, a model without repeated blocks is 'model': it falls back to
    one whole graph."""
    if cfg.compile_scope != "auto":
        chosen = cfg.compile_scope
    else:
        chosen = "blocks" if spec(strategy or cfg.strategy).compile_per_block or cfg.optimizer_in_backward else "model"
    if chosen == "blocks" and model is not None and not transformer_blocks(model):
        return "model"
    return chosen


def room_for_each_block(model: nn.Module) -> None:
    """Let dynamo keep a compiled version of a frame for every decoder block. DeepSpeed's ZeRO-3 hooks break the graph
    at each module; the hooks and (on the GPU) a block's forward were compiled once per module or block (a guard on its
    own attributes, such as DeepSpeed's ds_id), and from dynamo's recompile_limit (8) on the rest ran eagerly: half of
    llama-3.2-1b's 16 layers under zero3 --compile, 15% slower than with every layer compiled
    (benchmarks/results/*-h200-zero3-recompile-limit). FSDP2's hooks and per-block compile recompiled nothing
    on the CPU; the room costs them nothing."""
    import torch._dynamo

    need = 2 * len(transformer_blocks(model)) + 16  # a block's frames, and the hooks of the modules around the blocks
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, need)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, need)


def compile_blocks(model: nn.Module, cfg) -> bool:
    """With --compile and scope 'blocks', compile each decoder block in place; True if done (then the caller must not
    compile the whole model too). Every --compile path calls it first, so it also gives dynamo room for a version of
    each block's frames (``room_for_each_block``)."""
    if not cfg.compile:
        return False
    room_for_each_block(model)
    if scope(cfg, model) != "blocks":
        return False
    for block in transformer_blocks(model):
        block.compile(backend=backend(), **options(cfg))
    return True


BACKEND_ENV = "SHARDLAB_COMPILE_BACKEND"  # tests and debugging: e.g. aot_eager traces without inductor's minutes of C++


def backend() -> str:
    return os.environ.get(BACKEND_ENV) or "inductor"


def options(cfg) -> dict:
    """torch.compile's keyword arguments but the backend: ``compile_mode`` (torch's own 'default' passes nothing)."""
    return {} if cfg.compile_mode == "default" else {"mode": cfg.compile_mode}


def compile_module(module: nn.Module, cfg) -> nn.Module:
    """``torch.compile(module)`` as every --compile path calls it: this run's mode, ``backend()``."""
    return torch.compile(module, backend=backend(), **options(cfg))


def compile_model(model: nn.Module, cfg) -> nn.Module:
    """The module the strategy calls: ``model`` itself (unchanged, or its blocks compiled in place) or
    ``torch.compile(model)``."""
    if not cfg.compile or compile_blocks(model, cfg):
        return model
    return compile_module(model, cfg)
