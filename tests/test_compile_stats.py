"""Compile accounted for: compile_time_s from torch's own compile metrics, time_to_first_step_s from the
command's start, steady-state figures without the compiling steps, and inductor's caches in shardlab's
cache directory so that a second run of the same configuration loads its graphs."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
import torch

from shardlab.measure import compile_stats
from shardlab.measure.metrics import WARMUP_STEPS


def test_inductor_cache_goes_under_the_shardlab_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    assert compile_stats.use_persistent_cache() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert compile_stats.use_persistent_cache() == tmp_path / "mine"


def test_start_time_is_the_launchers_when_given(monkeypatch):
    import time

    monkeypatch.delenv(compile_stats.START_ENV, raising=False)
    own = compile_stats.process_start_time()
    assert own <= time.time()
    compile_stats.mark_start()
    assert float(compile_stats.process_start_time()) == pytest.approx(own)
    monkeypatch.setenv(compile_stats.START_ENV, "12.5")
    compile_stats.mark_start()  # a launcher above already recorded the start: kept
    assert compile_stats.process_start_time() == 12.5


def test_eager_work_counts_no_compile_time():
    clock = compile_stats.CompileClock()
    torch.nn.Linear(8, 8)(torch.randn(2, 8)).sum().backward()
    s = clock.summary()
    assert s["compile_time_s"] == 0 and s["compile_cache"]["hit"] is None


def _rows(out: Path) -> list[dict]:
    import json

    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_compiled_run_reports_compile_apart_and_second_run_hits_the_cache(train_cli, tmp_path, monkeypatch):
    """tiny-gpt2 dp --compile on the CPU, twice with one cache: the first compiles (cache misses), its compile time
    sits in the steps that compiled and outside the steady-state figures and the epoch time, and its losses are the
    eager run's (inductor's CPU backend changes speed, not the losses); the second loads. (The only test that compiles
    a whole model with inductor: the other compile tests compile blocks, the loss, or use aot_eager.)"""
    args = ["--model", "tiny-gpt2", "--strategy", "dp", "--compile", "--max-steps", "5", "--seq-len", "32", "--micro-batch", "2",
            "--log-every", "1", "--precision", "fp32", "--dropout", "0", "--set", "dataset.eval_split=0", "--set", "export=false"]
    eager = train_cli([a for a in args if a != "--compile"], tmp_path / "eager").check()
    # A cache of its own: an earlier compile of the same graph anywhere in the session (or on the machine) must not
    # turn the first run's misses into hits. (The runs still fork from the session's zygote: torch reads the variable
    # when it looks a graph up, zygote.RUNTIME_VALUE_ENV.)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    first = train_cli(args, tmp_path / "first", timeout=1200).check()  # inductor C++ compiles: minutes on a busy 2-core CPU
    s, rows = first.summary, _rows(first.out)
    assert s["compile"] is True and s["compile_time_s"] > 0 and s["compile_cache"]["fx_graph_miss"] > 0 and s["compile_cache"]["hit"] is False
    assert len(first.losses) == 5 and first.losses == pytest.approx(eager.losses, rel=1e-3)
    assert eager.summary["compile"] is False and eager.summary["compile_time_s"] == 0
    assert s["compile_cache"]["dir"] == str(tmp_path / "inductor") and Path(s["compile_cache"]["dir"]).is_dir()
    compiled_rows = [r for r in rows if r.get("compile_time_s")]
    assert compiled_rows and compiled_rows[0]["step"] == 1  # the first step compiles the forward and the backward
    for r in compiled_rows:
        assert r["compile_time_s"] <= r["step_time_s"]  # compiling is part of the step it happened in
    assert sum(r["compile_time_s"] for r in compiled_rows) == pytest.approx(s["compile_time_s"])
    # steady state: the median of the steps after the warm-up, which holds every step that compiled
    assert max(r["step"] for r in compiled_rows) <= WARMUP_STEPS == s["warmup_steps_excluded"]
    assert s["step_time_median_s"] == pytest.approx(statistics.median(r["step_time_s"] for r in rows[WARMUP_STEPS:]))
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["step_time_median_s"])
    (epoch,) = s["epochs"]
    assert epoch["compile_time_s"] == pytest.approx(s["compile_time_s"])
    assert epoch["epoch_time_s"] == pytest.approx(epoch["epoch_wall_time_s"] - epoch["compile_time_s"])
    assert s["time_to_first_step_s"] >= rows[0]["step_time_s"]  # start-up plus the first step

    second = train_cli(args, tmp_path / "second", timeout=1200).check()
    cache = second.summary["compile_cache"]
    assert cache["fx_graph_hit"] > 0 and cache["fx_graph_miss"] == 0 and cache["hit"] is True, cache


def test_runs_without_compile_get_no_pool_of_inductor_workers_and_the_plan_counts_the_pool_of_those_with(monkeypatch):
    from shardlab.config import RunConfig
    from shardlab.measure import compile_stats
    from shardlab.planning import planner

    import torch._inductor.config as inductor_config

    # set, then removed: monkeypatch restores the variable's absence even though limit_compile_workers sets it itself
    monkeypatch.setattr(inductor_config, "compile_threads", inductor_config.compile_threads)  # restored afterwards too
    monkeypatch.setenv(compile_stats.COMPILE_THREADS_ENV, "0")
    monkeypatch.delenv(compile_stats.COMPILE_THREADS_ENV)
    assert compile_stats.compile_workers(False) == 0 and compile_stats.compile_workers(True, cpus=16) == 16
    assert compile_stats.compile_workers(True, cpus=64) == 32  # inductor's own cap
    compile_stats.limit_compile_workers(True)
    assert compile_stats.COMPILE_THREADS_ENV not in os.environ
    compile_stats.limit_compile_workers(False)
    # inductor's config, imported here already (it decided at import), gets the value too
    assert os.environ[compile_stats.COMPILE_THREADS_ENV] == "1" and inductor_config.compile_threads == 1
    monkeypatch.setenv(compile_stats.COMPILE_THREADS_ENV, "4")
    compile_stats.limit_compile_workers(False)  # the user's value stays
    assert os.environ[compile_stats.COMPILE_THREADS_ENV] == "4" and compile_stats.compile_workers(False) == 4
    assert inductor_config.compile_threads == 4
    monkeypatch.delenv(compile_stats.COMPILE_THREADS_ENV)
    base = dict(model="gpt2", seq_len=128, micro_batch=2, precision="bf16")
    eager = planner.plan(RunConfig(**base), gpu_memory_gb=80, host_ram_gb=100, strategies=("dp",)).strategies["dp"]
    compiled = planner.plan(RunConfig(**base, compile=True), gpu_memory_gb=80, host_ram_gb=100, strategies=("dp",)).strategies["dp"]
    pool = compile_stats.compile_pool_bytes(compile_stats.compile_workers(True))
    assert not any("inductor" in k for k in eager.cpu_detail)
    assert compiled.cpu_per_node - eager.cpu_per_node == pytest.approx(pool, abs=1) or pool == 0
