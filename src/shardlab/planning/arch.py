"""The model's architecture as the planner sees it: parameter counts from the model built on the meta device (no
weights), the shape and dropout from its Hugging Face config, and the attention a CUDA run would get. ``Arch`` itself
is memory.py's (torch-free); reading one needs torch, and transformers once a config is read.

Callers read a run's architecture through this module (``arch.read_arch(cfg)``), not a name imported from it, so that
replacing ``read_arch`` here reaches every one of them (tools/golden_plans.py reads each model once that way).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import RunConfig
from ..errors import UserError
from ..layout import model_family
from ..strategies.deepspeed_config import sized_buckets, zero3_leaf_classes
from .memory import Arch, compiled_layers_modelled

# Lazy imports below: transformers (training.models) loads only when a model's config is read, and strategies/pipeline.py
# (torch.distributed) only when a pipeline's parts are counted; the memory formulas need neither.


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

    from ..training.models import block_params as largest_block, transformer_blocks

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
    block_params = largest_block(blocks)
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


def read_arch(cfg: RunConfig) -> Arch:
    """The architecture of ``cfg``'s model as a run of ``cfg`` builds it (on the meta device or not, random weights or a
    checkpoint's)."""
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
    return compiled_layers_modelled(arch if arch is not None else read_arch(cfg))
