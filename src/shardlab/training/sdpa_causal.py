"""SDPA's ``is_causal`` kernels under torch.compile too: no materialised causal mask for unpadded batches.

transformers builds each forward's attention mask in ``masking_utils.create_causal_mask``. For SDPA it skips the mask
when no token is padded (``_ignore_causal_mask_sdpa``) and attention runs with ``is_causal=True`` — but not while
dynamo traces: before torch 2.14 dynamo folds ``torch.compiler.is_exporting()`` to True, so transformers (5.17 to 5.24)
never skips when compiling and every compiled step attends through a (batch, 1, seq, seq) boolean mask. The kernel then
computes every block of the score matrix instead of the lower half and reads the mask: measured on an H100,
gpt2-medium micro 16, 590 µs per layer forward and 850 backward compiled against 133 / 193 µs at micro 8 eager, 31% of
the compiled step (benchmarks/results/2026-11-26-h100-attention).

Training never needs that mask when the batch has no padding (shardlab drops an all-ones ``attention_mask``,
trainer._without_trivial_mask) and queries and keys are the same positions (no KV cache). So the model runs under an
attention implementation of shardlab's, ``shardlab_sdpa``: transformers' own SDPA attention function, with a mask
function that returns no mask in exactly that case (the case transformers skips in eager mode) and otherwise defers to
transformers' SDPA mask (padding, sliding windows, packed-sequence or custom masks, caches). Registered through
transformers' ``AttentionInterface`` / ``AttentionMaskInterface``, so no transformers code is patched; the model's
config records ``_attn_implementation = "shardlab_sdpa"`` for the run only (it is not saved with exports).
"""

from __future__ import annotations

from typing import Any

NAME = "shardlab_sdpa"
_registered: dict[str, Any] = {}


def _mask(**kw: Any):
    """No mask for an unpadded, plain causal, full-length attention (SDPA's is_causal does it); else transformers'."""
    from transformers.masking_utils import causal_mask_function

    if "q_length" in kw:
        q_len = kw["q_length"]
    elif kw.get("cache_position") is not None:  # older transformers pass positions, not a length
        q_len = kw["cache_position"].shape[0]
    else:
        q_len = None
    local = kw.get("local_size")
    plain = (kw.get("allow_is_causal_skip", False) and kw.get("attention_mask") is None
             and kw.get("mask_function") is causal_mask_function and q_len is not None and q_len == kw.get("kv_length")
             and kw.get("kv_offset", 0) == 0 and isinstance(kw.get("q_offset", 0), int) and kw.get("q_offset", 0) == 0
             and (local is None or kw["kv_length"] < local))
    return None if plain else _registered["sdpa_mask"](**kw)


def register() -> bool:
    """Register ``shardlab_sdpa`` with transformers (once); False where this transformers lacks the interfaces."""
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    _registered["sdpa_mask"] = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return True


def use(model) -> bool:
    """Switch a model built with ``attn_implementation="sdpa"`` to ``shardlab_sdpa``; True if done (False leaves it on
    transformers' sdpa, which computes the same, masked under torch.compile)."""
    if not register():
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, AttributeError, ImportError):
        return False
    return model.config._attn_implementation == NAME
