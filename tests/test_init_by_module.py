"""shardlab.training.init_by_module: transformers' initialisation walked one module at a time draws the ordinary build's
weights bit for bit and holds at most the largest module's tensors (in-process, CPU, fast)."""

from __future__ import annotations

import pytest
import torch

from shardlab.config import RunConfig
from shardlab.training.init_by_module import init_by_module, peak_bytes
from shardlab.training.models import build_model

FAMILIES = ["tiny-gpt2", "tiny-bloom", "tiny-llama"]  # GPT-2's scaled c_proj init, BLOOM, Llama's rotary buffers


def _walk(skeleton, device="cpu"):
    """init_by_module's output as one dict, and the most bytes of real tensors the skeleton held at an emit."""
    got: dict[str, torch.Tensor] = {}
    held = []

    def emit(params, buffers):
        held.append(sum(t.numel() * t.element_size() for t in [*skeleton.parameters(), *skeleton.buffers()] if not t.is_meta))
        for name, value in {**params, **buffers}.items():
            assert name not in got, f"{name} emitted twice"
            got[name] = value.clone()

    init_by_module(skeleton, torch.device(device), emit)
    return got, max(held)


@pytest.mark.parametrize("name", FAMILIES)
def test_walk_draws_the_ordinary_builds_weights(name):
    cfg = RunConfig(model=name, seed=5)
    ordinary = build_model(cfg)
    skeleton = build_model(cfg, meta=True)
    torch.manual_seed(cfg.seed)  # as build_model seeds before its init
    got, held = _walk(skeleton)
    want = {**ordinary.state_dict(), **dict(ordinary.named_buffers())}  # rotary inv_freq is in no state dict
    assert set(want) - set(got) == {"lm_head.weight"}  # the tied head: emitted once, as the embedding
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])  # handed back as it began
    assert held == peak_bytes(skeleton)


@pytest.mark.parametrize("name", ["gpt2-medium", "bloom-560m", "smollm2-360m", "llama-2-7b"])
def test_walk_holds_the_largest_module_that_the_planner_counts(name):
    """The most the walk holds at once (found by its dry run over the meta skeleton, nothing drawn) is the largest
    module's own parameters, which the planner reads as Arch.largest_layer_params (strategies.fsdp.by_module_build_bytes);
    llama-2-7b's untied head is its largest, gpt2-medium's c_proj weights wait for their parent's scaled redraw."""
    from shardlab.planning.arch import read_arch
    from shardlab.strategies.fsdp import by_module_build_bytes

    cfg = RunConfig(model=name)
    skeleton = build_model(cfg, meta=True)
    n = sum(p.numel() for p in skeleton.parameters())
    largest = read_arch(cfg).largest_layer_params
    assert peak_bytes(skeleton) == 4 * largest < 4 * n / 2
    assert by_module_build_bytes(largest, 2) == 1.5 * peak_bytes(skeleton)  # and a rank's slice of it


def test_a_write_its_dry_run_did_not_see_is_refused(monkeypatch):
    """An init that writes a tensor already handed out (here: only once the tensors are real, which the meta dry run
    cannot see) fails loudly instead of being dropped; so does a parameter that no init writes."""
    cfg = RunConfig(model="tiny-llama")
    skeleton = build_model(cfg, meta=True)
    own = skeleton.model._init_weights  # LlamaModel, a sub-model, initialises its own modules (smart_apply)

    def late_write(module):
        own(module)
        if module is skeleton.model.norm and not module.weight.is_meta:
            torch.nn.init.zeros_(skeleton.model.embed_tokens.weight)

    monkeypatch.setattr(skeleton.model, "_init_weights", late_write, raising=False)
    with pytest.raises(RuntimeError, match="model.embed_tokens.weight outside the span"):
        _walk(skeleton)

    skeleton = build_model(cfg, meta=True)
    own = skeleton.model._init_weights
    monkeypatch.setattr(skeleton.model, "_init_weights", lambda m: None if m is skeleton.model.norm else own(m), raising=False)
    with pytest.raises(RuntimeError, match=r"wrote no value into \['model.norm.weight'\]"):
        _walk(skeleton)
