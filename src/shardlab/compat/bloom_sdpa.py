"""BLOOM attention through ``torch.nn.functional.scaled_dot_product_attention`` (ALiBi as an additive bias).

transformers' BLOOM (5.17 to 5.24) does not go through the attention interface
(``ALL_ATTENTION_FUNCTIONS``): ``BloomAttention.forward`` computes the scores itself with
``alibi.baddbmm(q, k^T)``, adds the 4-D mask, and runs the softmax in fp32, so every layer keeps
its seq² scores for the backward (fp32 softmax output plus its 16-bit cast): ~0.75 GiB per layer
for bloom-560m at micro 8, seq 1024. ``BloomPreTrainedModel`` declares no ``_supports_sdpa``
either, so ``attn_implementation="sdpa"`` is refused. Registering a function in the interface would
therefore change nothing; the least invasive robust way is to replace the ``forward`` of each
``BloomAttention`` instance (same signature, same projections and dropout/residual, same
``self.*`` attributes in both transformers versions), which touches no class and no other model.

The bias. ALiBi adds ``slope_h * pos_j`` to every score of key ``j``; the causal (and padding)
mask is the 4-D additive mask the model already built. SDPA takes their sum as ``attn_mask``, and
its memory-efficient CUDA kernel (the flash kernel takes no bias) keeps no scores: it saves the
bias and a log-sum-exp per row. The bias (batch, heads, q, kv) in the compute dtype is the only
seq² tensor, and it is built once per forward and shared by all layers (memoised on the mask
tensor, so it lives exactly as long as the forward's autograd graph needs it), not once per layer.
Under ``torch.compile`` it is rebuilt in each layer from the same inputs and the compiler is free
to share or recompute it (a memo on a tensor attribute would break the graph).

Each row is shifted by the query's own ALiBi value (softmax is invariant to a per-row constant,
so this is exact in real arithmetic): the bias is then ``slope_h * (pos_j - pos_i) <= 0``, small
near the diagonal, so a bf16 bias loses less than eager's absolute ``slope_h * pos_j`` (up to
~700 at seq 1024, i.e. steps of 4 in bf16) does.

FlexAttention (ALiBi as a ``score_mod``, no seq² tensor at all) was considered: it is only a fused
kernel when compiled, so eager runs would need a separately compiled attention with its compile
time at start-up and a recompile per new sequence length, and CPU support differs between
torch 2.11 and 2.13; SDPA's bias works eagerly and compiled on both.

Another transformers than those (compat.PATCHES) may have changed ``BloomAttention``: there the models module asks
``compat.enabled("bloom_sdpa")`` and resolves BLOOM's attention to eager, transformers' own.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from . import applied

# Lazy imports below: transformers' BLOOM module loads only when a BLOOM model is patched.

__all__ = ["use_sdpa_attention", "is_bloom", "alibi_bias"]

_MEMO = "_shardlab_sdpa_bias"


def is_bloom(model_class: type | None) -> bool:
    """Whether ``model_class`` is one of transformers' BLOOM models (this module's patch applies)."""
    return model_class is not None and model_class.__module__.startswith("transformers.models.bloom.")


def alibi_bias(alibi: torch.Tensor, mask: torch.Tensor | None, batch: int, heads: int, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive SDPA mask (batch, heads, q_len, kv_len): ALiBi shifted per row, plus the model's mask.

    ``alibi`` is BLOOM's (batch*heads, 1, kv_len) tensor; ``mask`` its 4-D additive mask (0 where a
    key is seen, the dtype's minimum where not), a boolean mask (True where seen) or None (causal).
    Built in fp32 and clamped to ``dtype``'s range before the cast, so a masked entry stays finite.
    A fully masked row (a left-padding query) gets a zero bias: eager's fp32 softmax of a row of
    ``min + x`` (which rounds to ``min``) is uniform over all keys, and SDPA's fused backward would
    recompute such a row's probabilities from a log-sum-exp that rounds the same way, giving
    gradients n times too large (measured on CPU); a zero row is uniform in both directions.
    """
    a = alibi.float().view(batch, heads, 1, -1)
    kv_len = a.shape[-1]
    # In place from here: the fp32 (batch, heads, q, kv) temporary is the largest tensor of the forward's start.
    bias = a - a[..., kv_len - q_len :].transpose(-1, -2)  # slope * (pos_j - pos_i)
    lowest = torch.finfo(torch.float32).min
    if mask is None:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).tril(kv_len - q_len)
        bias.masked_fill_(~causal, lowest)
    elif mask.dtype == torch.bool:
        bias.masked_fill_(~mask, lowest)
    else:
        bias.add_(mask)
    bias.masked_fill_((bias <= lowest / 2).all(dim=-1, keepdim=True), 0.0)
    return bias.clamp_(min=torch.finfo(dtype).min).to(dtype)


def _shared_bias(alibi: torch.Tensor, mask: torch.Tensor | None, batch: int, heads: int, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``alibi_bias`` built once per forward: every layer gets the same ``alibi`` and ``mask`` objects."""
    if torch.compiler.is_compiling():
        return alibi_bias(alibi, mask, batch, heads, q_len, dtype)
    owner = mask if mask is not None else alibi
    memo = getattr(owner, _MEMO, None)
    if memo is None or memo.dtype != dtype or memo.shape[-2] != q_len:
        memo = alibi_bias(alibi, mask, batch, heads, q_len, dtype)
        setattr(owner, _MEMO, memo)
    return memo


def _sdpa_forward(
    self: Any,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
):
    if output_attentions:  # the probabilities are asked for: only the eager path has them
        return self._shardlab_eager_forward(hidden_states, residual, alibi, attention_mask, layer_past, use_cache, output_attentions, **kwargs)
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch, q_len, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # 3 x (batch, heads, seq, head_dim)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    bias = _shared_bias(alibi, attention_mask, batch, self.num_heads, q_len, q.dtype)
    ctx = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=self.attention_dropout.p if self.training else 0.0, scale=self.inv_norm_factor
    )
    ctx = ctx.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
    out = dropout_add(self.dense(ctx), residual, self.hidden_dropout, self.training)
    return out, None


def use_sdpa_attention(model: torch.nn.Module) -> int:
    """Route every ``BloomAttention`` of ``model`` through SDPA; returns how many were patched.

    Modules the SDPA path cannot reproduce exactly stay eager: tensor-parallel slicing
    (``pretraining_tp > 1`` with ``slow_but_exact``) and an ALiBi scale ``beta`` other than 1.
    """
    from transformers.models.bloom.modeling_bloom import BloomAttention

    n = 0
    for module in model.modules():
        if not isinstance(module, BloomAttention):
            continue
        if (module.pretraining_tp > 1 and module.slow_but_exact) or module.beta != 1.0:
            continue
        module._shardlab_eager_forward = module.forward
        module.forward = types.MethodType(_sdpa_forward, module)
        n += 1
    if n:
        applied("bloom_sdpa")
    return n
