"""dp on several ranks wraps the model in DDP with gradient_as_bucket_view=True: the gradients the optimizer steps
are views of DDP's all-reduce buckets (no second copy of every gradient), and accumulation (no_sync), clipping and
zero_grad(set_to_none=True) work as before. One gloo rank in this process: DDP wraps whenever the strategy's world is
more than one, and a process group of one reduces like a larger one (divided by its size, 1)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardlab.config import load_config


@pytest.fixture
def gloo_rank(monkeypatch):
    from shardlab.runtime.distributed import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _micro_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(2)]


def test_dp_gradients_are_views_of_ddps_buckets(gloo_rank):
    from torch.nn.parallel import DistributedDataParallel

    from shardlab.runtime.distributed import DistEnv
    from shardlab.strategies.ddp import DDPStrategy
    from shardlab.runtime.resolved import Precision

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")  # "several ranks": DDP
    st = DDPStrategy(load_config(None, {"device": "cpu", "lr": 0.1, "max_grad_norm": 0.5}), env, Precision("fp32"), 2, 3)
    st.setup(model, total_steps=10)
    assert isinstance(st.model, DistributedDataParallel) and st.model.gradient_as_bucket_view

    for step in range(2):
        xs = _micro_batches()
        for i, x in enumerate(xs):  # two micro-batches: no_sync on the first, the all-reduce on the last
            with st.accumulate(last_micro=i == len(xs) - 1):
                st.backward(st.model(x).pow(2).mean() / len(xs), last_micro=i == len(xs) - 1)
        params = list(st.hf_model.parameters())
        storages = {p.grad.untyped_storage().data_ptr() for p in params}
        assert len(storages) == 1 and storages.isdisjoint(p.untyped_storage().data_ptr() for p in params)  # one bucket
        for x in xs:
            (ref(x).pow(2).mean() / len(xs)).backward()
        for p, q in zip(params, ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), step
        want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        norm = st.optimizer_step()
        assert norm == pytest.approx(float(want), rel=1e-5)
        assert all(p.grad is None for p in params)  # set_to_none drops the views; the bucket stays DDP's
        with torch.no_grad():  # the reference starts the next step from the same weights
            for q, p in zip(ref.parameters(), params):
                q.copy_(p)
        ref.zero_grad(set_to_none=True)
