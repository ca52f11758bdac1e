"""training/pinned.py: cached pinned host blocks given back after engine set-up (the GPU figure is in
benchmarks/results/2026-11-26-h100x2-ds-offload)."""

from __future__ import annotations

import os
import types

import torch

from shardlab.training import pinned


def test_a_cpu_run_has_no_pinned_cache_to_release(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: (_ for _ in ()).throw(AssertionError("called")))
    assert pinned.release_cached("cpu") == 0.0


def test_it_empties_the_host_cache_and_reports_what_went(monkeypatch):
    held = {"allocated_bytes.current": 20 * pinned.GIB}

    def empty():
        held["allocated_bytes.current"] = 4 * pinned.GIB  # 16 GiB of freed blocks were cached

    monkeypatch.setattr(torch.accelerator, "empty_host_cache", empty)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: dict(held))
    assert pinned.release_cached("cuda") == 16.0


def test_an_older_torch_uses_its_private_call_or_does_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "accelerator", types.SimpleNamespace())  # no empty_host_cache
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append(1), raising=False)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {})
    assert pinned.release_cached("cuda") == 0.0 and calls == [1]  # emptied; no stats to say how much
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    assert pinned.release_cached("cuda") == 0.0


def test_a_run_gives_back_the_cache_after_set_up_and_after_an_autotuned_first_step(tmp_path, monkeypatch):
    """Inductor's first-run autotuning copies the inputs a compiled kernel mutates (torchao's 8-bit step: the weight and
    its moments) to pinned host memory, which torch's allocator keeps cached for good: bloom-7b1 10.2 GiB of host memory
    against 2.0 with the graphs already cached (benchmarks/results/2026-11-27-h100-big-model). The trainer empties the
    cache after engine set-up, and after the first step of such runs only (others reuse their cached pinned blocks)."""
    import json

    from shardlab.config import RunConfig
    from shardlab.loop.trainer import run_worker

    def run(name: str, autotuned: bool):
        calls = []
        monkeypatch.setattr(pinned, "release_cached", lambda device_type: calls.append(device_type) or 0.75 * len(calls))
        monkeypatch.setattr(pinned, "autotuned_in_first_step", lambda optimizer: autotuned)
        cfg = RunConfig(model="tiny-gpt2", device="cpu", dataset={"source": "synthetic", "num_samples": 16}, seq_len=16,
                        micro_batch=2, max_steps=3, export=False, output_dir=str(tmp_path / name))
        env, threads = dict(os.environ), torch.get_num_threads()
        try:  # the worker runs in this process here: what it sets for itself (caches, threads) must not outlive the test
            result = run_worker(cfg)
        finally:
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(threads)
        assert result.summary["steps"] == 3
        return calls, json.loads((tmp_path / name / "summary.json").read_text())["pinned_released_gib"]

    assert run("plain", False) == (["cpu"], {"engine set-up": 0.75})
    assert run("autotuned", True) == (["cpu", "cpu"], {"engine set-up": 0.75, "the first step": 1.5})  # not every step


def test_which_first_steps_leave_pinned_copies():
    assert pinned.autotuned_in_first_step("adamw8bit")
    assert not pinned.autotuned_in_first_step("adamw")
