"""torch.compile of the model: whole, or each decoder block on its own (``compile_scope``).

Whole-model compile (``model``) gives inductor the largest graph; on one GPU it is at parity with the bare compiled
loop (benchmarks/results/2026-11-24-h100-speed). But a whole graph has one backward, so every gradient appears at
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

Measured on one H100 (gpt2-medium, micro 16, bf16; benchmarks/results/2026-11-25-h100-speed-big): fsdp per block
91.5k tok/s; fsdp whole-model 109.1k the day before (2026-11-24-h100-speed). Not side by side, so fsdp's ``auto``
stays the whole model until they are; ``blocks`` is its default only where one backward graph defeats the point of
the strategy (ao_offload, --optimizer-in-backward), and anyone can pick either with ``compile_scope``.
"""

from __future__ import annotations

import torch
from torch import nn

from .models import transformer_blocks


def scope(cfg, *, per_block: bool) -> str:
    """'model' or 'blocks' for this run; ``per_block`` = the strategy acts on gradients or blocks in hooks."""
    if cfg.compile_scope != "auto":
        return cfg.compile_scope
    return "blocks" if per_block or cfg.optimizer_in_backward else "model"


def compile_blocks(model: nn.Module, cfg, *, per_block: bool = False) -> bool:
    """With --compile and scope 'blocks', compile each decoder block in place; True if done (then the caller must not
    compile the whole model too)."""
    if not cfg.compile or scope(cfg, per_block=per_block) != "blocks":
        return False
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return bool(blocks)  # a model without repeated blocks falls back to one whole graph


def compile_model(model: nn.Module, cfg, *, per_block: bool = False) -> nn.Module:
    """The module the strategy calls: ``model`` itself (unchanged, or its blocks compiled in place) or
    ``torch.compile(model)``."""
    if not cfg.compile or compile_blocks(model, cfg, per_block=per_block):
        return model
    return torch.compile(model)
