"""What a run does to the process it runs in: `shardlab.train()` in a notebook or a test leaves the environment as it
found it, and a CPU-device run reuses its freed heap (launch/distributed.py: reuse_freed_heap)."""

from __future__ import annotations

import os
import resource
import sys

import pytest
import torch

import shardlab
from shardlab.launch.distributed import reuse_freed_heap


def _minor_faults_of_big_buffers(n: int = 6, mib: int = 96) -> int:
    """Page faults taken by allocating, touching and freeing a buffer above glibc's largest mmap threshold (32 MB)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.ones(mib << 18)  # float32: mib MiB, every page written
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_freed_big_buffers_are_reused_during_a_run_and_given_back_after():
    baseline = _minor_faults_of_big_buffers()  # each buffer mmapped anew: faulted in page by page (or huge page)
    with reuse_freed_heap() as active:
        if not active:
            pytest.skip("the C library is not glibc")
        _minor_faults_of_big_buffers(1)  # the heap grows once
        reused = _minor_faults_of_big_buffers()
        kept = _rss_mib()  # the freed buffer stays resident, ready for the next step
    released = _rss_mib()
    assert reused * 4 < baseline, (reused, baseline)
    assert released < kept - 64, (kept, released)  # the heap is trimmed: a notebook gets its memory back


def test_reuse_can_be_switched_off():
    with reuse_freed_heap(False) as active:
        assert active is False


def test_an_in_process_run_leaves_the_environment_as_it_found_it_and_runs_again(tmp_path):
    """A notebook's second `shardlab.train()` must not inherit the first one's RANK/WORLD_SIZE/MASTER_PORT (a
    multi-rank run launched after it would take itself for rank 0 of a running job) and must train the same."""
    before = dict(os.environ)
    losses = []
    for attempt in range(2):
        cfg = shardlab.RunConfig(model="tiny-gpt2", device="cpu", dataset={"source": "synthetic", "eval_samples": 1},
                                 seq_len=32, micro_batch=2, max_steps=2, seed=7, precision="fp32", export=False,
                                 eval_at_start=False, output_dir=str(tmp_path / f"run{attempt}"))
        result = shardlab.train(cfg)
        assert dict(os.environ) == before, sorted(set(os.environ.items()) ^ set(before.items()))
        losses.append(result.summary["final_train_loss"])
    assert losses[0] == losses[1]


def test_a_run_under_an_explicit_host_ram_budget_keeps_glibcs_default(tmp_path, monkeypatch):
    """The retained heap raises a CPU run's resident peak by up to ~25% (tiny-gpt2 micro 23 x 32: 1.22 GiB against
    under 1.0): a run given `cpu_memory_budget_gb`, which `--micro-batch auto` and the planner's host model hold it
    to, must not reuse it; without a budget it does."""
    from shardlab.training import trainer

    seen = []

    def recording(enabled=True):
        seen.append(enabled)
        return reuse_freed_heap(enabled)

    monkeypatch.setattr(trainer, "reuse_freed_heap", recording)
    for budget in (None, 4.0):
        cfg = shardlab.RunConfig(model="tiny-gpt2", device="cpu", dataset={"source": "synthetic", "eval_samples": 1},
                                 seq_len=32, micro_batch=2, max_steps=1, precision="fp32", export=False,
                                 eval_at_start=False, cpu_memory_budget_gb=budget, output_dir=str(tmp_path / f"b{budget}"))
        shardlab.train(cfg)
    assert seen == [True, False]
