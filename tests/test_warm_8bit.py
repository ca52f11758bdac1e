"""torchao's 8-bit step compiled before training (loop/warm_8bit.py): it must produce exactly the graphs the real
step then uses (else the first step compiles and autotunes again, with inductor's pinned host copies), and leave the
weights and the random state alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.config import RunConfig
from shardlab.planning.planner import eight_bit_state_bytes, eight_bit_warmup_bytes
from shardlab.compat.autotune import clones_on_device
from shardlab.loop import warm_8bit
from shardlab.training import optim

slow = pytest.mark.slow  # torchao's step compiles on the CPU: seconds a graph on 2 cores


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # (64, 64) and (128, 64) weights: 8-bit moments, two graphs; the 64 and 128 biases: fp32 moments, no decay, two more
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 128))


CFG = RunConfig(optimizer="adamw8bit", optimizer_in_backward=True, max_grad_norm=None, weight_decay=0.1)


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 64)).square().mean().backward()  # the in-backward optimizer steps in the gradient hooks


@slow
def test_the_real_first_step_compiles_nothing_after_the_warm_up():
    torch._dynamo.reset()
    cold = _model()
    opt = optim.build(cold, CFG, "cpu")
    assert len(warm_8bit.distinct(opt)) == 4  # two weights, two bias sizes
    before = _graphs()
    _step(cold)
    assert _graphs() - before == 4  # without the warm-up the first step compiles every graph

    torch._dynamo.reset()
    model = _model()
    opt = optim.build(model, CFG, "cpu")
    weights = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    out = warm_8bit.warm(opt, CFG)
    assert out["graphs"] == 4 and out["clones_on_device"] is True
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # scratch copies were stepped
    assert torch.equal(rng, torch.get_rng_state())
    assert all(not o.state for o in opt.optimizers.values())  # no moments created for the real parameters
    before = _graphs()
    _step(model)
    assert _graphs() == before  # the same graphs: dynamo's guards matched
    assert not any(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # and the real step ran


@slow
def test_the_warm_up_matches_a_plain_8bit_optimizer_too():
    """Without --optimizer-in-backward: one AdamW8bit over the decay / no-decay groups."""
    torch._dynamo.reset()
    model = _model()
    cfg = CFG.model_copy(update={"optimizer_in_backward": False})
    opt = optim.build(model, cfg, "cpu")
    assert warm_8bit.warm(opt, cfg)["graphs"] == 4
    before = _graphs()
    _step(model)
    opt.step()
    assert _graphs() == before


def test_clones_on_device_restores_inductors_choice():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    original = CachingAutotuner.copy_args_to_cpu_if_needed
    with clones_on_device() as steered:
        assert steered and CachingAutotuner.copy_args_to_cpu_if_needed(object()) == {}
    assert CachingAutotuner.copy_args_to_cpu_if_needed is original


@pytest.mark.parametrize("k, weight_bytes, measured_gib", [
    (250880 * 4096, 2, 21.166),  # bloom-7b1's embedding, bf16 weights (dp, H100)
    (50257 * 1024, 4, 1.505),  # gpt2-medium's, fp32 weights (dp, H200; fsdp on an H100: 1.495)
])
def test_warm_up_bytes_against_the_gpu(k, weight_bytes, measured_gib):
    """summary.json's eight_bit_warmup.gpu_peak_above_weights_gib (benchmarks/results/2026-11-27-h100-8bit-warmup)."""
    assert eight_bit_warmup_bytes(k, weight_bytes) / 2**30 == pytest.approx(measured_gib, rel=0.03)


def test_eight_bit_moments_follow_torchaos_layout():
    assert eight_bit_state_bytes(4096) == 2 * (4096 + 4 * 16)  # 1 B codes + an fp32 scale per 256 elements, twice
    assert eight_bit_state_bytes(1000) == 2 * 4 * 1000  # under 4096 elements: fp32 moments
