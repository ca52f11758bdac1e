"""compat/zero3_norm.py: ZeRO-3's gradient norm with one multi-tensor kernel, on one rank and on several (where each
rank's sum of squares is all-reduced, as DeepSpeed's get_grad_norm_direct does). The two- and three-rank runs that
check it end to end are tests/test_train_e2e.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardlab.compat import zero3_norm


class Opt:  # what foreach_norm reads of DeepSpeed's stage-3 optimizer
    offload_optimizer = False
    use_muon = False
    model_parallel_group = None
    fp16_groups = [["p0", "p1"], ["p2"]]
    _get_norm_groups = None  # DeepSpeed's, replaced

    def __init__(self):
        self.averaged_gradients = {0: [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])], 1: [torch.tensor([1.0, float("inf")])]}

    def _get_param_partition_group(self, param):
        return "partition group"


def test_the_norm_of_a_sub_group_is_deepspeeds_with_minus_one_when_not_finite(monkeypatch):
    monkeypatch.setattr("deepspeed.comm.get_world_size", lambda group=None: 1)
    monkeypatch.setattr("deepspeed.comm.all_reduce", lambda *a, **k: pytest.fail("one rank all-reduces nothing"))
    opt = Opt()
    zero3_norm.foreach_norm(opt)
    norms = opt._get_norm_groups()
    assert norms[0].item() == pytest.approx(5.0) and norms[0].dtype == torch.float32
    assert norms[1].item() == -1.0  # DeepSpeed's sentinel: is_invalid_grad_norm then skips or stops the step


def test_on_two_ranks_the_squares_are_summed_over_the_partition_group(monkeypatch):
    seen = []

    def all_reduce(tensor, op=None, group=None):  # the other rank holds the same partitions' squares: 25 + 25
        seen.append((group, tensor.dtype, tensor.item()))
        tensor.mul_(2)

    monkeypatch.setattr("deepspeed.comm.get_world_size", lambda group=None: 2)
    monkeypatch.setattr("deepspeed.comm.all_reduce", all_reduce)
    opt = Opt()
    opt.averaged_gradients[1] = [torch.tensor([0.0, 0.0])]
    zero3_norm.foreach_norm(opt)
    norms = opt._get_norm_groups()
    assert norms[0].item() == pytest.approx(50.0 ** 0.5)  # the root of the summed squares, not the sum of two norms
    assert seen == [("partition group", torch.float64, pytest.approx(25.0)), ("partition group", torch.float64, 0.0)]


@pytest.mark.parametrize("attr", ["offload_optimizer", "use_muon", "model_parallel_group"])
def test_a_norm_deepspeed_counts_another_way_keeps_deepspeeds_and_says_so(attr):
    opt = Opt()
    setattr(opt, attr, True)
    engine, lines = SimpleNamespace(optimizer=opt), []
    assert zero3_norm.apply(engine, lines.append) is False
    assert opt._get_norm_groups is None and len(lines) == 1 and attr in lines[0] and "not applied" in lines[0]
