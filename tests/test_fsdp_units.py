"""fsdp's one-rank speed options (issue 15): one FSDP2 unit for the whole model (``fsdp_units``) and the next step's
gather issued right after the optimizer step (``fsdp_gather_after_step``) train exactly as dp does (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from shardlab.config import RunConfig

_DP: dict = {}


def _losses(strategy: str, env, steps: int = 3, **options) -> tuple[list[float], object]:
    from shardlab.strategies import strategy_class
    from shardlab.runtime.resolved import Precision
    from shardlab.training.models import apply_dropout

    cfg = RunConfig(model="tiny-gpt2", strategy=strategy, device="cpu", seq_len=32, lr=1e-3, dropout=0.0,
                    max_grad_norm=None, strategy_options=options)
    st = strategy_class(strategy)(cfg, env, Precision("fp32"), 1, 2)
    model = st.build_model()
    apply_dropout(model, cfg.dropout)  # as the trainer does: no dropout, so both runs compute the same function
    st.setup(model, steps)
    st.train()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, st.hf_model.config.vocab_size, (2, 32), generator=gen)
        loss = st.forward({"input_ids": ids, "labels": ids})
        st.backward(loss, True)
        st.optimizer_step()
        losses.append(loss.item())
    return losses, st


def test_fsdp_units_resolution():
    from shardlab.strategies.fsdp import gather_after_step, units

    one = RunConfig(strategy="fsdp")
    assert units(one, 1) == "model" and units(one, 2) == "blocks"
    assert units(RunConfig(strategy="fsdp_offload"), 1) == "blocks"  # a unit is what is copied to the GPU at a time
    assert units(RunConfig(strategy="fsdp", strategy_options={"fsdp_units": "blocks"}), 1) == "blocks"
    assert units(RunConfig(strategy="fsdp", strategy_options={"fsdp_units": "model"}), 4) == "model"
    # on where the gathered params stay alive from forward to backward anyway: one rank, no offload
    assert gather_after_step(one, 1) and not gather_after_step(one, 2)
    assert not gather_after_step(RunConfig(strategy="fsdp_offload"), 1)
    assert gather_after_step(RunConfig(strategy="fsdp", strategy_options={"fsdp_reshard_after_forward": False}), 2)
    assert not gather_after_step(RunConfig(strategy="fsdp", strategy_options={"fsdp_gather_after_step": False}), 1)


@pytest.mark.parametrize("options", [
    {},  # one rank's defaults: one unit, gathered after the step
    {"fsdp_units": "blocks", "fsdp_gather_after_step": False},  # as before these options
    {"fsdp_units": "blocks", "fsdp_gather_after_step": True},
    {"fsdp_units": "model", "fsdp_gather_after_step": False},
], ids=["defaults", "blocks", "blocks-gather-after-step", "model-no-gather-after-step"])
def test_fsdp_one_rank_options_train_as_dp(one_rank, options):
    from torch.distributed.fsdp import FSDPModule

    if "ref" not in _DP:
        _DP["ref"] = _losses("dp", one_rank)[0]
    ref = _DP["ref"]
    got, st = _losses("fsdp", one_rank, **options)
    assert got == pytest.approx(ref, abs=1e-3)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5  # fp32: the same arithmetic, up to summation order
    n_units = sum(isinstance(m, FSDPModule) for m in st.hf_model.modules())
    assert (n_units == 1) is (options.get("fsdp_units", "model") == "model")
    # the state dict (checkpoints, export) is the sharded one even with the next step's params gathered
    sd = st.hf_model.state_dict()
    assert all(hasattr(v, "full_tensor") for k, v in sd.items() if k.endswith("weight"))



def test_plan_counts_the_one_unit_reduce_buffer():
    """One unit reduces the whole model at the end of backward: its fp32 input buffer (4 B/param) is planned then, at
    the optimizer-step moment; per-block units are not charged it. gpt2-medium's peak stays at the start of backward."""
    from shardlab.planning.planner import plan

    GiB = 2**30

    def planned(**opts):
        cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, precision="bf16", gpus=1, strategy_options=opts)
        p = plan(cfg, gpu_memory_gb=80, strategies=("fsdp",))
        return p, p.strategies["fsdp"]

    p, one = planned()
    note = [x for x in one.notes if x.startswith("fp32 reduce-scatter input of the whole model")]
    assert note == [f"fp32 reduce-scatter input of the whole model (one FSDP unit): {4 * p.n_params / GiB:.2f} GiB"]
    _, blocks = planned(fsdp_units="blocks")
    assert not [x for x in blocks.notes if x.startswith("fp32 reduce-scatter input")]
    assert one.gpu_peak == blocks.gpu_peak  # activations dominate: the same peak, as measured (17.25 GiB both)


def test_blocks_per_unit_gives_each_unit_enough_work_on_several_ranks():
    """On several ranks a unit holds blocks until it reaches UNIT_PARAM_TOKENS (parameters x a micro-batch's tokens):
    gpt2-large's 19.7M-parameter blocks at 8 x 1024 tokens, host-bound one and two to a unit on an H200, go three to a
    unit; llama-3.2-1b's 60.8M ones, which kept 97% on two H200s one to a unit, stay one."""
    from shardlab.planning.arch import read_arch
    from shardlab.strategies.fsdp import blocks_per_unit

    cfg = RunConfig(model="gpt2-large", strategy="fsdp", seq_len=1024, micro_batch=8, precision="bf16")
    large, llama = read_arch(cfg), read_arch(cfg.model_copy(update={"model": "llama-3.2-1b"}))
    assert blocks_per_unit(cfg, 2, large.block_params, 8 * 1024, large.layers) == 3
    assert blocks_per_unit(cfg, 2, llama.block_params, 8 * 1024, llama.layers) == 1
    assert blocks_per_unit(cfg, 2, large.block_params, 32 * 1024, large.layers) == 1  # a larger micro-batch is work enough
    assert blocks_per_unit(cfg, 1, large.block_params, 8 * 1024, large.layers) == 1  # one rank: nothing measured
    assert blocks_per_unit(cfg, 4, 10, 10, 3) == 3  # never more than the model has
    assert blocks_per_unit(cfg, 2, large.block_params, 512, large.layers) == 4  # nor more than the most measured
    offload = RunConfig(**{**cfg.model_dump(), "strategy": "fsdp_offload"})
    assert blocks_per_unit(offload, 2, large.block_params, 8 * 1024, large.layers) == 1  # a unit at a time on the GPU
    given = RunConfig(**{**cfg.model_dump(), "strategy_options": {"fsdp_blocks_per_unit": 2}})
    assert blocks_per_unit(given, 2, large.block_params, 8 * 1024, large.layers) == 2

