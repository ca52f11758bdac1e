"""One rank of a real `--strategy pipeline` step on CPU, with its memory measured (used by test_plan_pipeline.py).

    RANK=r WORLD_SIZE=P MASTER_ADDR=127.0.0.1 MASTER_PORT=port python tests/pipeline_memory_probe.py OUT.json CONFIG.yaml [CONFIG.yaml ...]

Builds PipelineStrategy exactly as the trainer does, runs one optimizer step (so the optimizer states and
torch.distributed.pipelining's receive buffers exist), then profiles the second step (schedule + optimizer
step) with torch.profiler's memory events: the peak of the running sum of allocations minus frees in that
window, plus what was already held when it began (parameters, optimizer states, receive buffers and the
previous step's kept logits, counted from the live objects), is the rank's peak allocated memory.
Several configs run one after the other in the same processes (one process group): the imports are paid once.
"""

from __future__ import annotations

import json
import sys

import torch
from allocations import peak_allocated
from torch.profiler import ProfilerActivity, profile

from shardlab.config import load_config
from shardlab.runtime.distributed import init_distributed, shutdown_distributed
from shardlab.training.models import build_model
from shardlab.runtime.resolved import Precision
from shardlab.strategies.pipeline import PipelineStrategy
from shardlab.training.batches import DevicePrefetcher
from shardlab.training.models import apply_dropout


def held_bytes(strategy: PipelineStrategy) -> int:
    storages: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for m in strategy.stage_modules:
        for p in m.parameters():
            add(p)
    for state in strategy.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                add(v)
    stages = getattr(strategy.schedule, "_stages", None) or [strategy.schedule._stage]
    for st in stages:
        for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
            for info in infos:
                if getattr(info, "buffer", None) is not None:
                    add(info.buffer)
        for out in st.output_chunks:
            add(out)
    return sum(storages.values())


def measure(cfg, env) -> dict:
    micro, accum, _ = cfg.resolve_batch(1)
    model = build_model(cfg)
    apply_dropout(model, cfg.dropout)  # as Trainer.run does
    strategy = PipelineStrategy(cfg, env, Precision("fp32"), accum, micro)
    strategy.setup(model, total_steps=10)
    strategy.train()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def batches():
        out = []
        for _ in range(accum):
            ids = torch.randint(0, vocab, (micro, cfg.seq_len), generator=gen)
            out.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
        return DevicePrefetcher(iter(out), env.device, accum)

    strategy.train_step(batches())
    strategy.optimizer_step()
    it = batches()
    it.preload()  # the batch is host data the loader made before the step
    # What schedule.step does first (clear_runtime_states drops the previous step's kept logits), done
    # before the window: the profiler cannot see frees of blocks allocated before it started.
    stages = getattr(strategy.schedule, "_stages", None) or [strategy.schedule._stage]
    for st in stages:
        st.output_chunks.clear()
    # zbv's turn of the V: the stage after it on this rank takes the output itself as its input (set_local_fwd_input), the
    # stage before it the input gradient as its output gradient (set_local_bwd_input): each replaces a receive buffer,
    # whose free the profiler cannot see when it was made before the window. Those buffers are dropped here and made
    # again at the window's start, so that their replacement is seen as the free it is.
    local = {st.stage_index for st in stages}
    swapped = [info for st in stages if st.stage_index - 1 in local for infos in st.args_recv_info.values() for info in infos]
    swapped += [info for st in stages if st.stage_index + 1 in local for infos in st.grad_recv_info.values() for info in infos]
    shapes = [(info.buffer.shape, info.buffer.dtype, info.buffer.requires_grad) for info in swapped]
    for info in swapped:
        info.buffer = None
    before = held_bytes(strategy)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for info, (shape, dtype, grad) in zip(swapped, shapes):
            info.buffer = torch.zeros(shape, dtype=dtype, requires_grad=grad)
        strategy.train_step(it)
        strategy.optimizer_step()
    peak = peak_allocated(prof)
    env.barrier()
    return {"rank": env.rank, "held_before": before, "peak_delta": peak, "peak": before + peak, "bounds": [list(b) for b in strategy.bounds]}


def main() -> None:
    env = init_distributed("cpu")
    results = [measure(load_config(path), env) for path in sys.argv[2:]]
    with open(sys.argv[1], "w") as fh:
        json.dump(results, fh)
    shutdown_distributed()


if __name__ == "__main__":
    main()
