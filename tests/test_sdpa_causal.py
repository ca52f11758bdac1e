"""training/sdpa_causal.py: no materialised causal mask for unpadded batches, under torch.compile too."""

from __future__ import annotations

import pytest
import torch

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


def test_compiled_unpadded_forward_builds_no_mask_and_matches_transformers(mask_calls, models):
    ours, theirs = models
    assert ours.config._attn_implementation == "shardlab_sdpa"
    ids = torch.randint(0, 1000, (2, 16))
    expected = theirs(ids).logits
    torch._dynamo.reset()
    got = torch.compile(ours, backend="aot_eager")(ids).logits  # the mask is decided while dynamo traces: no inductor needed
    assert mask_calls == []  # transformers' mask function was never needed: SDPA ran with is_causal
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


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
