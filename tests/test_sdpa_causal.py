"""training/sdpa_causal.py: no materialised causal mask for unpadded batches, under torch.compile too."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F

from shardlab.config import RunConfig
from shardlab.training import sdpa_causal
from shardlab.training.models import build_model


@pytest.fixture
def mask_calls(monkeypatch):
    """Calls that fell through to transformers' own SDPA mask (a materialised mask)."""
    assert sdpa_causal.register()
    calls = []
    original = sdpa_causal._registered["sdpa_mask"]
    monkeypatch.setitem(sdpa_causal._registered, "sdpa_mask", lambda **kw: calls.append(kw) or original(**kw))
    return calls


@pytest.fixture(scope="module")
def models():
    """tiny-gpt2 as shardlab builds it (shardlab_sdpa) and the same weights on transformers' sdpa."""
    cfg = RunConfig(model="tiny-gpt2", device="cpu", dropout=0.0, seq_len=32)
    ours = build_model(cfg)
    theirs = build_model(cfg)
    theirs.set_attn_implementation("sdpa")
    return ours.eval(), theirs.eval()


def test_sdpa_models_run_under_shardlab_sdpa_and_export_without_it(tmp_path, models):
    ours, theirs = models
    assert ours.config._attn_implementation == "shardlab_sdpa" and theirs.config._attn_implementation == "sdpa"
    ours.save_pretrained(tmp_path)
    assert "shardlab_sdpa" not in (tmp_path / "config.json").read_text()
    eager = build_model(RunConfig(model="tiny-gpt2", device="cpu", attn_implementation="eager"))
    assert eager.config._attn_implementation == "eager"  # only sdpa models switch


@pytest.fixture
def sdpa_calls(monkeypatch):
    """(got a mask, is_causal) of every F.scaled_dot_product_attention call."""
    calls = []
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None or (len(args) > 3 and args[3] is not None), kwargs.get("is_causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_compiled_unpadded_forward_builds_no_mask_and_matches_transformers(mask_calls, sdpa_calls, models):
    """While dynamo traces, transformers can neither skip the mask nor rule out packing (the model's own position_ids):
    for unpacked rows (what Strategy.forward says of its batches) SDPA still runs is_causal, unmasked."""
    ours, theirs = models
    assert ours.config._attn_implementation == "shardlab_sdpa"
    ids = torch.randint(0, 1000, (2, 16))
    expected = theirs(ids).logits
    torch._dynamo.reset()
    with sdpa_causal.unpacked_rows():  # the mask is decided while dynamo traces: aot_eager suffices, no inductor
        got = torch.compile(ours, backend="aot_eager")(ids, use_cache=False).logits  # as Strategy.forward calls it
    assert set(sdpa_calls) == {(False, True)} and mask_calls == []
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # without that knowledge the packed-sequence term stands and transformers builds the mask, as for its own sdpa
    sdpa_calls.clear()
    torch._dynamo.reset()
    torch.compile(ours, backend="aot_eager")(ids, use_cache=False)
    assert set(sdpa_calls) == {(True, False)} and len(mask_calls) == 1


def test_strategy_forward_says_when_rows_are_unpacked():
    from shardlab.strategies.base import Strategy

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, **inputs):
            seen.append(sdpa_causal._unpacked)
            return types.SimpleNamespace(loss=torch.zeros(()))

    fake = types.SimpleNamespace(model=Probe(), loss_fn=None, cfg=RunConfig(), autocast=contextlib.nullcontext)
    fake._forward = lambda batch, inputs: Strategy._forward(fake, batch, inputs)
    ids = torch.zeros(1, 4, dtype=torch.long)
    Strategy.forward(fake, {"input_ids": ids, "labels": ids})
    Strategy.forward(fake, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    assert seen == [True, False] and sdpa_causal._unpacked is False


def test_padding_still_gets_transformers_mask(mask_calls, models):
    ours, theirs = models
    ids = torch.randint(0, 1000, (2, 16))
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 12:] = 0
    got = ours(ids, attention_mask=pad).logits
    assert len(mask_calls) == 1 and mask_calls[0]["attention_mask"] is not None
    torch.testing.assert_close(got, theirs(ids, attention_mask=pad).logits, rtol=1e-5, atol=1e-5)


def test_only_the_plain_full_length_causal_case_skips(mask_calls):
    from transformers.masking_utils import causal_mask_function

    plain = dict(batch_size=1, q_length=8, kv_length=8, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, allow_is_causal_skip=True, device="cpu")
    assert sdpa_causal._mask(**plain) is None and mask_calls == []
    for change in ({"kv_length": 12, "q_offset": 4}, {"allow_is_causal_skip": False}, {"local_size": 4}):
        assert sdpa_causal._mask(**{**plain, **change}) is not None
    sdpa_causal._mask(**{**plain, "mask_function": lambda *a: True})  # a custom mask: transformers decides
    assert len(mask_calls) == 4
