"""compat/zero3_one_rank.py: one-rank ZeRO-3 skips the step's release/re-gather of parameters that are views of
their partitions and the reduce-scatter to itself (and, as on any number of ranks, compat/zero3_norm.py takes the norm
without per-tensor kernels). They change host work, not the arithmetic: the same run with DeepSpeed's own path has the
same losses and gradient norms."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardlab.compat import zero3_one_rank
from test_train_e2e import train_args


def test_one_rank_reduce_scatter_returns_the_gradients_and_leaves_bigger_groups_to_deepspeed(monkeypatch):
    from deepspeed.runtime.zero import stage3

    seen = []
    monkeypatch.setattr(stage3, "reduce_scatter_coalesced", lambda tensors, group=None: seen.append(group) or "deepspeed's")
    sizes = {"one": 1, "two": 2}
    monkeypatch.setattr("deepspeed.comm.get_world_size", lambda group=None: sizes[group])
    zero3_one_rank.identity_reduce_scatter()
    zero3_one_rank.identity_reduce_scatter()  # installed once, not wrapped twice
    installed = stage3.reduce_scatter_coalesced
    assert getattr(installed, zero3_one_rank._MARK) and not getattr(installed.__wrapped__, zero3_one_rank._MARK, False)
    grads = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    out = installed(grads, "one")
    assert [o.shape for o in out] == [(6,), (4,)] and all(o.data_ptr() == g.data_ptr() for o, g in zip(out, grads))
    assert seen == []
    assert installed(grads, "two") == "deepspeed's" and seen == ["two"]


def test_an_engine_of_another_shape_runs_deepspeeds_path_and_says_so():
    class Engine:
        optimizer = SimpleNamespace(step=lambda: None)  # no fp16_groups, no _partition_all_parameters

    engine = Engine()
    lines = []
    assert zero3_one_rank.apply(engine, ("keep_gathered",), lines.append) == []
    assert vars(engine.optimizer).keys() == {"step", zero3_one_rank._MARK}  # nothing installed
    assert len(lines) == 1 and "not applied" in lines[0] and "fp16_groups" in lines[0]


@pytest.mark.slow  # two tiny zero3 runs (~25 s each on 2 cores)
def test_the_shortcuts_change_no_loss_and_no_gradient_norm(shared_runs):
    fast = shared_runs.get(train_args(strategy="zero3", steps=8), name="zero3-shortcuts")
    own = shared_runs.get(train_args(strategy="zero3", steps=8, extra=["--set", "strategy_options.zero3_one_rank_shortcuts=[]",
                                                                      "--set", "strategy_options.zero3_foreach_norm=false"]),
                          name="zero3-deepspeeds-path")
    fast.check(), own.check()
    assert fast.summary["zero3_one_rank_shortcuts"] == list(zero3_one_rank.SHORTCUTS)
    # every step skipped the release and the re-gather once DeepSpeed's trace was complete: while it records one (the
    # first two training steps, after the initial eval's), its coordinator releases even persistent parameters after
    # use, so those steps find them released and take DeepSpeed's own path
    assert 6 <= fast.summary["zero3_steps_kept_gathered"] <= 8
    assert "zero3_one_rank_shortcuts" not in own.summary
    assert {"keep_gathered", "identity_reduce_scatter", "foreach_norm"} <= set(fast.summary["patches"])  # the norm: zero3_norm
    assert not {"keep_gathered", "identity_reduce_scatter", "foreach_norm"} & set(own.summary["patches"])
    assert len(fast.rows) == len(own.rows) == 8
    for a, b in zip(fast.rows, own.rows):
        # the weights after each step are the same tensors' in-place update: a stale view would show from step 2 on
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), (a["step"], a["grad_norm"], b["grad_norm"])
    assert fast.summary["final_eval_loss"] == pytest.approx(own.summary["final_eval_loss"], rel=1e-6)
