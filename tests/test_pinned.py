"""training/pinned.py: cached pinned host blocks given back after engine set-up (the GPU figure is in
benchmarks/results/2026-11-26-h100x2-ds-offload)."""

from __future__ import annotations

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
