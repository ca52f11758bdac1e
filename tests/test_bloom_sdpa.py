"""BLOOM attention through SDPA with an ALiBi bias (shardlab.compat.bloom_sdpa): chosen by auto, the same
training losses and gradients as transformers' eager BLOOM in fp32 on the CPU, and the seq² memory the
planner counts for it (one shared bias instead of per-layer scores), measured with saved-tensor hooks."""

from __future__ import annotations

import pytest
import torch

from shardlab.config import RunConfig
from shardlab.training.models import build_hf_config, build_model, resolve_attn_implementation


def _bloom(attn: str, **kw):
    return build_model(RunConfig(model="tiny-bloom", device="cpu", attn_implementation=attn, **kw))


def _patched(model) -> int:
    from transformers.models.bloom.modeling_bloom import BloomAttention

    return sum(1 for m in model.modules() if isinstance(m, BloomAttention) and "forward" in vars(m))


def test_auto_picks_sdpa_for_bloom_and_patches_every_layer():
    from transformers import BloomForCausalLM, GPT2LMHeadModel

    assert resolve_attn_implementation("auto", "cuda", BloomForCausalLM) == "sdpa"
    assert resolve_attn_implementation("sdpa", "cpu", BloomForCausalLM) == "sdpa"  # was a UserError before
    assert resolve_attn_implementation("auto", "cpu", GPT2LMHeadModel) == "sdpa"
    model = _bloom("auto")
    assert _patched(model) == model.config.n_layer == 2
    assert _patched(_bloom("eager")) == 0


def test_ten_training_steps_same_losses_as_eager():
    """fp32 on the CPU, AdamW, 10 steps: each step's loss within 1e-3 relative of eager BLOOM."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1000, (2, 32), generator=g) for _ in range(10)]
    losses = {}
    for attn in ("eager", "sdpa"):
        model = _bloom(attn).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[attn] = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[attn].append(loss.item())
    assert losses["eager"][-1] < losses["eager"][0]  # it trains, so the steps compare different weights
    for step, (want, got) in enumerate(zip(losses["eager"], losses["sdpa"])):
        assert got == pytest.approx(want, rel=1e-3), (step, losses)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_batches_same_loss_and_gradients_as_eager(padding):
    """A 2-D attention mask (padding) goes through the model's own 4-D mask; a fully masked (left-padding)
    query row must not get SDPA's over-scaled backward (alibi_bias zeroes such rows)."""
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, -9:] = 0
    else:
        mask[1, :9] = 0
    labels = ids.masked_fill(mask == 0, -100)
    grads, losses = {}, {}
    for attn in ("eager", "sdpa"):
        model = _bloom(attn)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        losses[attn] = out.loss.item()
        grads[attn] = {n: p.grad for n, p in model.named_parameters()}
    assert losses["sdpa"] == pytest.approx(losses["eager"], rel=1e-5)
    for n, want in grads["eager"].items():
        torch.testing.assert_close(grads["sdpa"][n], want, rtol=1e-3, atol=1e-5, msg=n)


def _seq2_storages(model, b: int, s: int) -> dict[int, int]:
    """The storages of the (.., s, s) tensors autograd keeps for the backward: {data_ptr: bytes}."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.dim() == 4 and t.shape[-2:] == (s, s):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 1000, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    return seen


def test_bias_is_built_once_per_forward():
    """All layers share one (batch, heads, seq, seq) bias: the only seq² tensor autograd keeps, where
    eager keeps each layer's fp32 softmax output."""
    b, s = 2, 48  # not tiny-bloom's width 64, so (b, s, hidden) activations are not mistaken for scores
    sdpa, eager = _bloom("sdpa"), _bloom("eager")
    one = b * sdpa.config.n_head * s * s * 4  # fp32
    assert list(_seq2_storages(sdpa, b, s).values()) == [one]
    assert sorted(_seq2_storages(eager, b, s).values()) == [one] * eager.config.n_layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_counts_the_sdpa_bloom_activations(dtype):
    """The planner's BLOOM 'sdpa' activations (no per-layer scores, one shared bias) against exact CPU
    measurements, on a wide small-vocab BLOOM whose layers dominate."""
    from transformers import AutoModelForCausalLM, BloomConfig

    from shardlab.compat.bloom_sdpa import use_sdpa_attention
    from shardlab.planning.arch import arch_from_hf_config
    from shardlab.planning.planner import activation_bytes
    from tests.test_plan import _saved_bytes

    c = BloomConfig(n_layer=2, hidden_size=256, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(c, dtype=getattr(torch, dtype), attn_implementation="eager")
    assert use_sdpa_attention(model) == 2
    arch = arch_from_hf_config(c, attn_impl="sdpa")
    mode = "fp32" if dtype == "float32" else "lp"
    for seq, micro in ((64, 2), (512, 2)):  # at 512 the shared bias is 17% of the total (fp32)
        measured = _saved_bytes(model, micro, seq)
        predicted = activation_bytes(arch, micro, seq, mode, "cpu").saved_at_forward_end
        assert predicted == pytest.approx(measured, rel=0.02), (dtype, seq, micro)


def test_planned_attention_for_bloom_is_sdpa():
    from shardlab.planning.arch import _planned_attn

    cfg = RunConfig(model="bloom-560m")
    assert _planned_attn(cfg, build_hf_config(cfg)) == "sdpa"


@pytest.mark.slow
def test_compiles_as_one_graph():
    """Under torch.compile the bias is built in each layer (no memo on a tensor attribute): no graph break,
    forward and backward through AOTAutograd (backend aot_eager: inductor's C++ compile is minutes on a busy CPU)."""
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    model = _bloom("sdpa")
    want = model(input_ids=ids, labels=ids, use_cache=False).loss
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids, use_cache=False).loss
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
