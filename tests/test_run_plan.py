"""`shardlab train` plans itself before any worker starts: the record in summary.json, the GPU warning
with what would fit instead, the --compile caveat, and a planning failure that must not stop a run."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from shardlab.config import RunConfig
from shardlab.planning.budget import usable
from shardlab.planning.memory import RESERVED_OVER_ALLOCATED, GiB
from shardlab.planning.planner import plan
from shardlab.planning.run_plan import PLAN_KEYS, predict_run, warning_line

# Measured H100 peaks (GiB) per strategy: tests/data/README.md says where they come from.
MEASURED_H100 = json.loads((Path(__file__).parent / "data" / "h100_foundation_peaks.json").read_text())


def _fits(cfg: RunConfig, gpu_gib: float) -> bool:
    sp = plan(cfg, gpu_memory_gb=gpu_gib, strategies=(cfg.strategy,)).strategies[cfg.strategy]
    return sp.gpu_peak * RESERVED_OVER_ALLOCATED <= usable(gpu_gib * GiB)


def test_gpu_record_that_fits():
    """The H100 foundation run's config: the record's prediction is the plan's (the same figure, rounded), within 5% of
    what was measured (-0.2%; tests/test_plan.py::test_h100_foundation_errors holds every strategy of that run to 5%)."""
    cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, grad_accum=1, precision="bf16", strategy="dp",
                    loss_kernel="hf")  # as measured: the loss inside the model
    rec = predict_run(cfg, "cuda", 1, gpu_memory=79.1, host_ram=128)
    assert set(PLAN_KEYS) <= set(rec) and rec["strategy"] == "dp" and rec["fits"] is True
    assert isinstance(rec["gpu_peak_gib"], float) and isinstance(rec["cpu_gib"], float)
    planned = plan(cfg, gpu_memory_gb=79.1, host_ram_gb=128, strategies=("dp",)).strategies["dp"]
    assert rec["gpu_peak_gib"] == pytest.approx(planned.gpu_peak / GiB, abs=1e-3)  # the record is the plan's figure
    assert rec["gpu_peak_gib"] == pytest.approx(MEASURED_H100["dp"], rel=0.05)
    assert rec["gpu_memory_gib"] == 79.1 and rec["micro_batch"] == 8 and rec["max_micro_batch"] > 8
    assert rec["compile_modelled"] is None and "error" not in rec
    assert warning_line(rec) is None


def test_gpu_warning_names_what_fits_instead():
    cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, grad_accum=1, precision="bf16", strategy="dp", loss_kernel="hf")
    rec = predict_run(cfg, "cuda", 1, gpu_memory=28.0, host_ram=128)
    assert rec["fits"] is False and rec["need_gib"] > 28 > rec["gpu_peak_gib"]  # the peak alone would fit: context + fragmentation do not
    line = warning_line(rec)
    assert "\n" not in line and line.startswith("warning: the plan predicts dp will not fit")
    assert f"{rec['need_gib']:.1f} GiB per GPU (peak {rec['gpu_peak_gib']:.1f} GiB" in line and "28.0 GiB GPUs" in line
    assert "fits instead:" in line and "--gradient-checkpointing" in line
    # every suggestion is one the plan predicts to fit
    m = re.search(r"--micro-batch (\d+) --grad-accum (\d+) \(same global batch\)", line)
    assert m and int(m[1]) * int(m[2]) == 8 and int(m[1]) <= rec["max_micro_batch"]
    assert _fits(cfg.model_copy(update={"micro_batch": int(m[1]), "grad_accum": int(m[2])}), 28.0)
    larger = [d for d in range(int(m[1]) + 1, 8) if 8 % d == 0]  # the largest divisor of 8 that fits
    assert not larger or not _fits(cfg.model_copy(update={"micro_batch": larger[0], "grad_accum": 8 // larger[0]}), 28.0)
    assert _fits(cfg.model_copy(update={"gradient_checkpointing": True}), 28.0)
    s = re.search(r"--strategy (\w+)", line)
    assert s and _fits(cfg.model_copy(update={"strategy": s[1]}), 28.0)
    # and the first of them is the fastest such strategy in the planner's speed order
    from shardlab.planning.planner import SPEED_ORDER

    faster = SPEED_ORDER[: SPEED_ORDER.index(s[1])]
    assert not any(_fits(cfg.model_copy(update={"strategy": f}), 28.0) for f in faster if f != "dp")


# gpt2-medium dp --compile, micro 16, seq 1024, bf16, shardlab's compiled loss and padded head, 1 x H100: peak
# allocated 22.242 GiB (benchmarks/results/2026-11-26-h100-speed/call1/speed.json, three runs); the eager plan of the
# same run says 40.1 GiB.
H100_COMPILED_GPT2_MEDIUM_GIB = 22.242


def test_a_compiled_run_is_planned_as_compiled():
    cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=16, grad_accum=1, precision="bf16", strategy="dp", compile=True)
    rec = predict_run(cfg, "cuda", 1, gpu_memory=40.0, host_ram=128)
    assert rec["compile_modelled"] is True and any(n.startswith("--compile: the decoder layers") for n in rec["notes"])
    assert rec["gpu_peak_gib"] == pytest.approx(H100_COMPILED_GPT2_MEDIUM_GIB, rel=0.05)
    eager = predict_run(cfg.model_copy(update={"compile": False}), "cuda", 1, gpu_memory=40.0, host_ram=128)
    assert eager["compile_modelled"] is None and eager["gpu_peak_gib"] > 1.5 * H100_COMPILED_GPT2_MEDIUM_GIB
    # a family whose compiled layers were never traced is planned as eager, and says so
    import dataclasses

    from shardlab.planning import memory
    from shardlab.planning.arch import read_arch

    arch = dataclasses.replace(read_arch(cfg.model_copy(update={"model": "tiny-gpt2"})), family="generic")
    assert memory.compiled_layers_modelled(arch) is False
    assert memory._compiled_layer_bytes(arch, "autocast", "cuda") == memory._layer_bytes(arch, "autocast", "cuda")


def test_cpu_record_and_a_planner_failure(monkeypatch):
    cfg = RunConfig(model="tiny-gpt2", seq_len=64, micro_batch=2, strategy="zero2", device="cpu")
    rec = predict_run(cfg, "cpu", 2, host_ram=16)
    assert rec["gpu_peak_gib"] is None and rec["fits"] is None and rec["strategy"] == "zero2"
    # two ranks of ~0.7 GiB (process baseline + tiny model), what their heaps keep, and the process that spawned them
    assert 2 * 0.6 < rec["cpu_gib"] - rec["heap_kept_gib"] < 2 * 1.0 + 0.5 and rec["heap_reuse"]
    assert 0 < rec["heap_kept_gib"] < 2 * rec["per_rank_gib"]
    assert warning_line(rec) is None

    import shardlab.planning.strategy_plan  # run_plan looks predict_cpu_run up there at each call

    def broken(*a, **k):
        raise RuntimeError("a bug in the planner")

    monkeypatch.setattr(shardlab.planning.strategy_plan, "predict_cpu_run", broken)
    rec = predict_run(cfg, "cpu", 1)
    assert rec == {"gpu_peak_gib": None, "cpu_gib": None, "fits": None, "strategy": "zero2", "device": "cpu",
                   "error": "RuntimeError: a bug in the planner"}


@pytest.mark.slow
def test_spawned_ranks_write_the_launchers_plan(tmp_path, train_cli):
    """Two gloo ranks (the launcher's spawn path: plan.json beside the config): the pipeline split in the
    record is the one the strategy really used."""
    run = train_cli(["--model", "tiny-gpt2", "--strategy", "pipeline", "--gpus", "2", "--device", "cpu", "--max-steps", "2",
                     "--micro-batch", "2", "--grad-accum", "2", "--seq-len", "32", "--no-export",
                     "--set", "dataset.eval_samples=1"], tmp_path / "pp")  # fmt: skip
    run.check()
    rec = run.summary["plan"]
    assert set(PLAN_KEYS) <= set(rec) and rec["strategy"] == "pipeline" and rec["device"] == "cpu"
    assert rec["gpu_peak_gib"] is None and rec["cpu_gib"] > 0 and "error" not in rec
    used = re.search(r"blocks split (\[.*?\])", run.stdout)[1]
    assert [tuple(b) for b in rec["pipeline_split"]] == ast.literal_eval(used)
    assert [s["gpu"] for s in rec["stages"]] == [0, 1]


def test_a_cpu_run_tight_for_the_kept_heap_gives_freed_memory_back(monkeypatch):
    """The heap kept for reuse makes CPU steps faster but holds more (planning/host.heap_kept_bytes): a node that fits
    the run only with glibc's default gets that, says so in one line, and the worker does not keep the heap."""
    import contextlib

    from shardlab.runtime.distributed import heap_reuse
    from shardlab.planning.memory import HOST_HEADROOM, host_fits
    from shardlab.planning.strategy_plan import predict_cpu_run
    from shardlab.planning.run_plan import check_host_ram, heap_line

    cfg = RunConfig(model="gpt2", device="cpu", seq_len=256, micro_batch=2, precision="fp32")
    glibc = predict_cpu_run(cfg, 1, reuse_heap=False)[1] / GiB
    kept = predict_cpu_run(cfg, 1, reuse_heap=True)[1] / GiB
    assert glibc + 0.5 < kept  # gpt2: 3.70 against 4.65 GiB
    roomy = predict_run(cfg, "cpu", 1, host_ram=20)
    assert roomy["heap_reuse"] and roomy["cpu_gib"] == pytest.approx(kept, abs=1e-3) and heap_reuse(cfg, "cpu", roomy)
    assert heap_line(cfg, roomy) is None
    ram = glibc * HOST_HEADROOM + 0.1  # fits with glibc's default, not with the kept heap
    assert host_fits(glibc, ram) and not host_fits(kept, ram)
    tight = predict_run(cfg, "cpu", 1, host_ram=ram)
    assert tight["heap_reuse"] is False and tight["cpu_gib"] == pytest.approx(glibc, abs=1e-3)
    check_host_ram(cfg, tight, "cpu", 1, available_gib=ram)  # no refusal
    assert not heap_reuse(cfg, "cpu", tight) and "freed memory goes back to the system" in heap_line(cfg, tight)
    # an explicit host-RAM budget is planned with glibc's default; GPU runs never touch the heap
    budget = cfg.model_copy(update={"cpu_memory_budget_gb": 10})
    assert predict_run(budget, "cpu", 1, host_ram=20)["heap_reuse"] is False and not heap_reuse(budget, "cpu", roomy)
    assert heap_line(budget, tight) is None and not heap_reuse(cfg, "cuda", roomy)

    # the worker passes the decision to reuse_freed_heap
    import shardlab.loop.trainer as trainer

    seen = []

    @contextlib.contextmanager
    def fake_heap(enabled):
        seen.append(enabled)
        yield enabled

    class Done(Exception):
        pass

    def no_trainer(*a, **k):
        raise Done

    monkeypatch.setattr(trainer, "reuse_freed_heap", fake_heap)
    monkeypatch.setattr(trainer, "Trainer", no_trainer)
    for record in (roomy, tight, None):
        with pytest.raises(Done):
            trainer.run_worker(cfg, plan=record)
    assert seen == [True, False, True]  # a rank without the record (torchrun's others) keeps the heap
