"""SDPA's ``is_causal`` kernels under torch.compile too: no materialised causal mask for unpadded batches.

transformers builds each forward's attention mask in ``masking_utils.create_causal_mask``. For SDPA it skips the mask
when no token is padded (``_ignore_causal_mask_sdpa``) and attention runs with ``is_causal=True`` — but not while
dynamo traces: before torch 2.14 dynamo folds ``torch.compiler.is_exporting()`` to True, so transformers (5.17 to 5.24)
never skips when compiling and every compiled step attends through a (batch, 1, seq, seq) boolean mask. The kernel then
computes every block of the score matrix instead of the lower half and reads the mask: measured on an H100,
gpt2-medium micro 16, 590 µs per layer forward and 850 backward compiled against 133 / 193 µs at micro 8 eager, 31% of
the compiled step (benchmarks/results/*-h100-attention).

While tracing, transformers also cannot rule out packed sequences: the model's own ``position_ids`` (an arange it
makes itself) go through ``find_packed_sequence_indices``, which returns a tensor instead of None when it cannot read the
values, and the causal mask function becomes ``and_masks(causal, packed)`` with the skip disabled.

Training never needs a mask when the batch has no padding (shardlab drops an all-ones ``attention_mask``,
batches.without_trivial_mask), passes no ``position_ids`` (one sequence per row: nothing is packed) and queries and
keys are the same positions (no KV cache). So the model runs under an attention implementation of shardlab's,
``shardlab_sdpa``: transformers' own SDPA attention function, with a mask function that returns no mask
- for a plain causal mask over full-length, unpadded rows (the case transformers itself skips in eager mode), and
- inside ``unpacked_rows()``, which Strategy.forward enters for batches with neither attention_mask nor position_ids:
  there the packed-sequence term is known to be the identity,
and otherwise defers to transformers' SDPA mask (padding, sliding windows longer than the sequence, custom masks,
caches). Only for the families whose masks are just these (``FAMILIES``); others keep transformers' sdpa. Registered
through transformers' ``AttentionInterface`` / ``AttentionMaskInterface``, so no transformers code is patched; the
config records ``_attn_implementation = "shardlab_sdpa"`` for the run only (it is not saved with exports).
"""

from __future__ import annotations

import contextlib
from typing import Any

NAME = "shardlab_sdpa"
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")  # model_type: causal masks, optionally a sliding window
_registered: dict[str, Any] = {}
_unpacked = False  # inside unpacked_rows(); read while dynamo traces, which guards on it


@contextlib.contextmanager
def unpacked_rows(active: bool = True):
    """The model is called on rows that are one sequence each, unpadded: its mask can only be the plain causal one."""
    global _unpacked
    before, _unpacked = _unpacked, bool(active)
    try:
        yield
    finally:
        _unpacked = before


def _mask(**kw: Any):
    """No mask where SDPA's is_causal computes the same (see the module doc); else transformers' SDPA mask."""
    from transformers.masking_utils import causal_mask_function

    if "q_length" in kw:
        q_len = kw["q_length"]
    elif kw.get("cache_position") is not None:  # older transformers pass positions, not a length
        q_len = kw["cache_position"].shape[0]
    else:
        q_len = None
    local = kw.get("local_size")
    full_causal = (kw.get("attention_mask") is None and q_len is not None and q_len == kw.get("kv_length")
                   and kw.get("kv_offset", 0) == 0 and isinstance(kw.get("q_offset", 0), int) and kw.get("q_offset", 0) == 0
                   and (local is None or kw["kv_length"] < local))
    plain = kw.get("allow_is_causal_skip", False) and kw.get("mask_function") is causal_mask_function
    return None if full_causal and (plain or _unpacked) else _registered["sdpa_mask"](**kw)


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
    if getattr(model.config, "model_type", None) not in FAMILIES or not register():
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, AttributeError, ImportError):
        return False
    return model.config._attn_implementation == NAME
