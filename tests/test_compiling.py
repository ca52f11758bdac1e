"""--compile's scope (shardlab.training.compiling): which strategies compile per block, and what each scope does to
the model. Compiling is lazy, so these build the compiled wrappers without running inductor."""

from __future__ import annotations

import torch

from shardlab.config import RunConfig
from shardlab.specs.registry import spec
from shardlab.training import compiling
from shardlab.training.models import build_model, transformer_blocks


def cfg(**kw) -> RunConfig:
    return RunConfig(model="tiny-gpt2", **kw)


def test_auto_scope_follows_the_strategy_spec_and_in_backward():
    import shardlab.specs  # noqa: F401  (registers the names)

    assert not spec("dp").compile_per_block and spec("ao_offload").compile_per_block
    assert compiling.scope(cfg(compile=True)) == "model"
    assert compiling.scope(cfg(compile=True, strategy="ao_offload")) == "blocks"
    # stepping in gradient hooks needs the gradients block by block, whatever the strategy
    assert compiling.scope(cfg(compile=True, optimizer_in_backward=True, max_grad_norm=None)) == "blocks"
    assert compiling.scope(cfg(compile=True, strategy="ao_offload", compile_scope="model")) == "model"
    assert compiling.scope(cfg(compile=True, compile_scope="blocks")) == "blocks"


def test_a_model_without_blocks_is_compiled_whole_and_says_so():
    """'blocks' asked of a model with no repeated blocks: one whole graph, and the scope reported (summary.json's
    compile_scope) is the one that ran."""
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    c = cfg(compile=True, compile_scope="blocks")
    assert not transformer_blocks(flat)
    assert compiling.scope(c, flat) == "model"
    assert isinstance(compiling.compile_model(flat, c), torch._dynamo.eval_frame.OptimizedModule)
    assert compiling.scope(c, build_model(cfg())) == "blocks"


def test_blocks_scope_compiles_each_block_in_place_and_model_scope_wraps():
    model = build_model(cfg())
    assert compiling.compile_model(model, cfg()) is model  # no --compile: untouched
    assert all(b._compiled_call_impl is None for b in transformer_blocks(model))

    same = compiling.compile_model(model, cfg(compile=True, compile_scope="blocks"))
    assert same is model and not isinstance(same, torch._dynamo.eval_frame.OptimizedModule)
    blocks = transformer_blocks(model)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)

    whole = compiling.compile_model(build_model(cfg()), cfg(compile=True, compile_scope="model"))
    assert isinstance(whole, torch._dynamo.eval_frame.OptimizedModule)


def test_dynamo_gets_room_for_a_version_of_each_blocks_frames():
    """Where the graph breaks at each block, a block's frames are compiled once per block: the limit is raised to hold
    them all (training/compiling.room_for_each_block), never lowered."""
    import torch._dynamo

    config = torch._dynamo.config
    before = config.recompile_limit, config.accumulated_recompile_limit
    try:
        config.recompile_limit = 8
        compiling.room_for_each_block(build_model(cfg()))  # tiny-gpt2: 2 blocks
        assert config.recompile_limit == 2 * 2 + 16
        config.recompile_limit = 100
        compiling.room_for_each_block(build_model(cfg()))
        assert config.recompile_limit == 100
    finally:
        config.recompile_limit, config.accumulated_recompile_limit = before


def test_zero3_compile_builds_with_torchs_own_linear(one_rank):
    """DeepSpeed's memory-efficient linear (zero.Init swaps F.linear for its autograd Function), compiled by torch 2.11,
    gave a linear with a bias zero weight and bias gradients (benchmarks/results/2026-11-29-h200-zero3-compile-linear:
    BLOOM's gradient norm a quarter of eager's, Qwen2's 57%; torch 2.13, this image's, computes them right, so only the
    build can be checked here): zero3 --compile builds with torch's own F.linear, eager zero3 keeps DeepSpeed's."""
    import torch.nn.functional as F

    from shardlab.runtime.resolved import Precision
    from shardlab.strategies.deepspeed_zero import DeepSpeedStrategy

    torchs = F.linear
    eager = RunConfig(model="tiny-bloom", strategy="zero3", device="cpu", seq_len=32, micro_batch=1, grad_accum=1)
    DeepSpeedStrategy(eager, one_rank, Precision("fp32"), 1, 1).build_model()
    assert torch.nn.functional.linear is not torchs  # DeepSpeed's default: the swap this test would miss otherwise
    torch.nn.functional.linear = torchs
    compiled = eager.model_copy(update={"compile": True})
    st = DeepSpeedStrategy(compiled, one_rank, Precision("fp32"), 1, 1)
    st.build_model()
    assert torch.nn.functional.linear is torchs
    assert st.ds_config()["zero_optimization"]["memory_efficient_linear"] is False


def test_a_deepspeed_json_that_turns_the_memory_efficient_linear_on_under_compile_is_refused(tmp_path):
    """The user's JSON overrides shardlab's choice: turning DeepSpeed's linear back on under zero3 --compile is refused
    in one line, before any worker, naming the key; without --compile, or turned off, it runs."""
    import json

    import pytest

    from shardlab.errors import UserError
    from shardlab.runtime.resolved import assumed_run
    from shardlab.strategies import strategy_class

    on, off = tmp_path / "on.json", tmp_path / "off.json"
    on.write_text(json.dumps({"zero_optimization": {"memory_efficient_linear": True}}))
    off.write_text(json.dumps({"zero_optimization": {"memory_efficient_linear": False}}))
    run = RunConfig(model="tiny-bloom", strategy="zero3", compile=True, precision="bf16", deepspeed_config=str(on))
    for device in ("cuda", "cpu"):
        with pytest.raises(UserError, match="memory_efficient_linear true with zero3 --compile") as err:
            strategy_class("zero3").check_options(assumed_run(run, device, world=2))
        assert "drop memory_efficient_linear" in err.value.hint
    strategy_class("zero3").check_options(assumed_run(run.model_copy(update={"compile": False}), "cuda", world=2))
    strategy_class("zero3").check_options(assumed_run(run.model_copy(update={"deepspeed_config": str(off)}), "cuda", world=2))
    strategy_class("zero3").check_options(assumed_run(run.model_copy(update={"deepspeed_config": None}), "cuda", world=2))
