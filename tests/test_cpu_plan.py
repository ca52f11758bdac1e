"""`shardlab plan --device cpu`: the host memory of a CPU run under every strategy, the same prediction `shardlab
train` checks before a CPU run starts, with the reason where a strategy cannot run on a CPU."""

from __future__ import annotations

import json

import pytest

from shardlab.cli import main
from shardlab.config import RunConfig
from shardlab.planning.memory import host_fits
from shardlab.planning.run_plan import predict_run
from shardlab.specs.registry import all_specs, speed_order

FLAGS = ["plan", "--device", "cpu", "--model", "tiny-gpt2", "--seq-len", "64", "--micro-batch", "2", "--json"]


def _plan(capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert main([*FLAGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_strategy_is_planned_or_refused_and_the_fastest_that_fits_is_recommended(capsys):
    p = _plan(capsys, "--host-ram-gb", "50")
    rows = {r["strategy"]: r for r in p["rows"]}
    assert list(rows) == [s.name for s in all_specs()]
    assert "needs a CUDA GPU" in rows["ao_offload"]["refused"] and rows["ao_offload"]["host_gib"] is None
    assert "NVMe" in rows["infinity"]["refused"]
    # one owner: each figure is the record `shardlab train` checks for that strategy
    for s in ("dp", "zero3", "fsdp_offload"):
        rec = predict_run(RunConfig(model="tiny-gpt2", seq_len=64, micro_batch=2, device="cpu", strategy=s), "cpu", 1,
                          host_ram=50)
        assert rows[s]["host_gib"] == rec["cpu_gib"] and rows[s]["fits"] is True
    assert p["recommendation"] == next(s for s in speed_order() if rows[s]["fits"]) and p["fix"] is None
    assert (p["ranks"], p["micro_batch"], p["grad_accum"], p["precision"]) == (1, 2, 1, "fp32")


def test_two_cpu_ranks_are_planned_as_a_whole_run(capsys):
    one, two = _plan(capsys, "--host-ram-gb", "50"), _plan(capsys, "--host-ram-gb", "50", "--gpus", "2")
    dp1, dp2 = (next(r for r in p["rows"] if r["strategy"] == "dp") for p in (one, two))
    assert two["ranks"] == 2 and dp2["host_gib"] > dp1["host_gib"]  # every rank holds its own replica and process
    # ... and the `shardlab train` process that spawned them waits beside them (0.44 GiB measured with its supervisor)
    from shardlab.planning.host import CPU_LAUNCHER_RSS_BYTES, CPU_PROCESS_RSS_BYTES

    GiB = 2**30
    assert dp1["heap_reuse"] and dp2["heap_reuse"]  # 50 GiB: room for the heap kept between steps
    ranks = 2 * (dp2["per_rank_gib"] + CPU_PROCESS_RSS_BYTES / GiB) + dp2["heap_kept_gib"]
    assert dp2["host_gib"] == pytest.approx(ranks + CPU_LAUNCHER_RSS_BYTES / GiB, abs=2e-3)
    one_rank = dp1["per_rank_gib"] + CPU_PROCESS_RSS_BYTES / GiB + dp1["heap_kept_gib"]  # one rank: itself
    assert dp1["host_gib"] == pytest.approx(one_rank, abs=2e-3)
    # a pipeline is planned as `train` runs it (its default micro-batches per stage), and the run notes that the
    # other strategies' checks print stay out of the JSON
    staged = _plan(capsys, "--host-ram-gb", "50", "--gpus", "2", "--stages", "2")
    pipe = next(r for r in staged["rows"] if r["strategy"] == "pipeline")
    assert pipe["refused"] is None and pipe["host_gib"] > 0


def test_nothing_fits_names_what_train_would_suggest(capsys):
    p = _plan(capsys, "--host-ram-gb", "0.3")
    assert p["recommendation"] is None
    assert not any(r["fits"] for r in p["rows"]) and all(not host_fits(r["host_gib"], 0.3) for r in p["rows"] if r["host_gib"])
    assert p["fix"] and "--force" in p["fix"]
    assert p["fix_for"] == next(s for s in speed_order() if any(r["strategy"] == s and r["host_gib"] for r in p["rows"]))


def test_the_table_and_the_mistakes(capsys):
    capsys.readouterr()
    assert main([a for a in FLAGS if a != "--json"] + ["--host-ram-gb", "50"]) == 0
    out = capsys.readouterr().out
    assert "Predicted host memory of the whole CPU run" in out and "Recommended: dp" in out
    assert main(["plan", "--device", "cpu", "--micro-batch", "auto"]) == 2
    assert "needs a micro batch" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU's memory would be read")
def test_without_a_gpu_the_fix_names_the_cpu_plan(capsys):
    assert main(["plan", "--model", "tiny-gpt2"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-memory-gb" in err and "--device cpu" in err
