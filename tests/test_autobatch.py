"""`--micro-batch auto`: the search against fake trials with a known limit, the batch triple, the plan's
starting point, and bad inputs. A real CPU trial runs in test_plan_validation_script.py (through
`shardlab train --micro-batch auto`, the same path as on a GPU)."""

from __future__ import annotations

import math

import pytest

from shardlab.planning.autobatch import (
    Trial,
    check_auto,
    micro_candidates,
    resolve_auto_micro_batch,
    search_micro_batch,
    trial_config,
    with_micro_batch,
)
from shardlab.cli import main
from shardlab.config import RunConfig, config_from_dict
from shardlab.errors import UserError


class FakeGPU:
    """A trial runs iff the micro batch is at most `limit`; above it is out of memory (exit 3)."""

    def __init__(self, limit: int, broken: set[int] = frozenset()):
        self.limit, self.broken, self.calls = limit, broken, []

    def __call__(self, m: int) -> Trial:
        self.calls.append(m)
        if m in self.broken:
            return Trial(m, ok=False, message="error: the training data has fewer blocks than one global batch")
        return Trial(m, ok=m <= self.limit, oom=m > self.limit, peak_gib=m * 1.0)


ALL = list(range(1, 4097))


@pytest.mark.parametrize("start,limit", [(5, 13), (13, 13), (40, 13), (1, 1), (100, 3000), (4096, 4096), (7, 8)])
def test_search_finds_the_largest_that_runs_from_any_start(start, limit):
    gpu = FakeGPU(limit)
    chosen, trials = search_micro_batch(start, ALL, gpu)
    assert chosen == limit
    assert len(gpu.calls) == len(set(gpu.calls))  # no value is tried twice
    ran = {t.micro for t in trials if t.ok}
    oom = {t.micro for t in trials if t.oom}
    assert limit in ran
    assert limit == 4096 or limit + 1 in oom  # the one above was tried: the answer is within one step
    assert len(trials) <= 2 * math.log2(max(abs(start - limit), 1) + 1) + 3


def test_a_good_plan_needs_two_trials():
    gpu = FakeGPU(13)
    chosen, trials = search_micro_batch(13, ALL, gpu)
    assert chosen == 13 and gpu.calls == [13, 14]
    assert [t.result for t in trials] == ["ran", "out of memory"]


def test_global_batch_restricts_the_micro_batches_to_divisors():
    cfg = RunConfig(model="tiny-gpt2", micro_batch="auto", global_batch=48)
    cands = micro_candidates(cfg, 2)  # 24 sequences per rank
    assert cands == [1, 2, 3, 4, 6, 8, 12, 24]
    gpu = FakeGPU(10)
    chosen, _ = search_micro_batch(4, cands, gpu)
    assert chosen == 8 and set(gpu.calls) <= set(cands) and 12 in gpu.calls
    # the global batch is kept: the accumulation follows the micro batch
    assert with_micro_batch(cfg, chosen).resolve_batch(2) == (8, 3, 48)
    # a given grad_accum is kept instead (the global batch follows)
    cfg = RunConfig(model="tiny-gpt2", micro_batch="auto", grad_accum=4)
    assert micro_candidates(cfg, 2, upper=6) == [1, 2, 3, 4, 5, 6]
    assert with_micro_batch(cfg, 5).resolve_batch(2) == (5, 4, 40)


def test_step_up_off_never_tries_above_the_start():
    gpu = FakeGPU(100)
    assert search_micro_batch(10, list(range(1, 11)), gpu, step_up=False) == (10, [Trial(10, True, peak_gib=10.0)])
    gpu = FakeGPU(7)
    chosen, _ = search_micro_batch(10, list(range(1, 11)), gpu, step_up=False)
    assert chosen == 7 and max(gpu.calls) == 10


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(UserError, match="even micro batch 1 does not fit") as err:
        search_micro_batch(8, ALL, FakeGPU(0))
    assert "gradient-checkpointing" in str(err.value)


def test_a_failure_that_is_not_memory():
    # before anything ran: the real run would fail the same way -> the trial's error, at once
    gpu = FakeGPU(50, broken={8})
    with pytest.raises(UserError, match="trial run at micro batch 8 failed: error: the training data"):
        search_micro_batch(8, ALL, gpu)
    assert gpu.calls == [8]
    # above a micro batch that ran it only bounds the search
    gpu = FakeGPU(50, broken={9, 10, 12})
    chosen, trials = search_micro_batch(8, ALL, gpu)
    assert chosen == 8 and any(t.result == "failed" for t in trials)


def test_resolve_on_cpu_with_a_fake_trial(capsys):
    """The plan's start under a host-RAM budget, a trial over the budget steps down, the line says so."""
    cfg = RunConfig(model="tiny-gpt2", device="cpu", seq_len=64, micro_batch="auto", global_batch=24, cpu_memory_budget_gb=1.2)
    lines = []
    gpu = FakeGPU(5)
    resolved, result = resolve_auto_micro_batch(cfg, "cpu", 1, trial=gpu, log=lines.append)
    assert result.plan_start >= 6  # the plan alone would have allowed more than really "fits" here
    assert resolved.micro_batch == result.chosen == 4  # divisors of 24 up to the fake limit 5
    assert (result.grad_accum, result.global_batch) == (6, 24)
    assert max(gpu.calls) <= result.plan_start  # on CPU never above the plan
    assert result.budget_gib == pytest.approx(1.2)
    assert lines[-1].startswith("--micro-batch auto: 4 (plan: ") and "-> micro 4 x accum 6 = global batch 24" in lines[-1]
    assert "1.2 GiB host-RAM budget" in lines[0]
    # the plan's start is the largest allowed micro batch predicted within the budget
    from shardlab.planning.strategy_plan import predict_cpu_run

    start = result.plan_start
    predicted = lambda m: predict_cpu_run(with_micro_batch(cfg, m).model_copy(update={"gpus": 1}), 1, reuse_heap=False)[1]  # noqa: E731
    assert predicted(start) <= 1.2 * 2**30
    above = [m for m in micro_candidates(cfg, 1) if m > start]
    assert not above or predicted(above[0]) > 1.2 * 2**30


def test_trial_config_is_the_run_shortened(tmp_path):
    cfg = RunConfig(model="tiny-gpt2", micro_batch="auto", global_batch=16, epochs=3, save_every=5, export=True,
                    resume="auto", wandb=True, eval_every=10)
    t = trial_config(cfg, 4, tmp_path / "t")
    assert (t.micro_batch, t.max_steps, t.epochs, t.save_every, t.export, t.resume, t.wandb, t.eval_every) == (4, 2, None, None, False, None, False, None)
    assert t.global_batch == 16 and t.resolve_batch(2) == (4, 2, 16) and t.output_dir == str(tmp_path / "t")
    assert t.dataset.eval_samples == 4 and t.model == cfg.model and t.strategy == cfg.strategy


def test_bad_inputs_are_one_line_errors(monkeypatch, capsys):
    with pytest.raises(UserError, match="already fix the micro batch"):
        check_auto(RunConfig(micro_batch="auto", grad_accum=2, global_batch=16), 1)
    with pytest.raises(UserError, match="not divisible by the data-parallel world size 3"):
        check_auto(RunConfig(micro_batch="auto", global_batch=16), 3)
    with pytest.raises(UserError, match="one node"):
        check_auto(RunConfig(micro_batch="auto", nodes=2), 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="own launcher"):
        check_auto(RunConfig(micro_batch="auto"), 2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(UserError, match="no value until the search has run"):
        RunConfig(micro_batch="auto").resolve_batch(1)
    for bad in ("two", 0, -3, True, 2.5):
        with pytest.raises(UserError, match="'micro_batch' must be a positive integer or 'auto'"):
            config_from_dict({"micro_batch": bad})
    assert config_from_dict({"micro_batch": "auto"}).micro_batch == "auto"
    # through the CLI: one line, exit 2, before anything runs
    for argv, words in (
        (["--micro-batch", "auto", "--grad-accum", "2", "--global-batch", "8"], "already fix the micro batch"),
        (["--micro-batch", "big"], "positive integer or 'auto', got 'big'"),
        (["--micro-batch", "auto", "--cpu-memory-budget-gb", "-1"], "cpu_memory_budget_gb"),
    ):
        assert main(["train", "--model", "tiny-gpt2", "--device", "cpu", "--max-steps", "1", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and words in err, err


def test_dry_run_shows_where_the_search_starts(capsys):
    argv = ["train", "--dry-run", "--model", "tiny-gpt2", "--device", "cpu", "--seq-len", "64", "--micro-batch", "auto",
            "--global-batch", "32", "--cpu-memory-budget-gb", "1.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("# micro_batch auto: the search would start at ") and "1.5 GiB host-RAM budget" in first
    start = int(first.split("start at ")[1].split()[0])
    assert f"micro_batch: {start}\n" in out and 32 % start == 0


def test_plan_with_micro_batch_auto():
    from shardlab.planning.budget import usable
    from shardlab.planning.memory import RESERVED_OVER_ALLOCATED, GiB
    from shardlab.planning.planner import plan

    cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch="auto", global_batch=64, precision="bf16", gpus=1, strategy="zero2")
    p = plan(cfg, gpu_memory_gb=80)
    assert 64 % p.micro_batch == 0 and p.micro_batch * p.grad_accum == 64
    assert any("micro batch 'auto': each strategy is planned at its own" in n for n in p.notes)
    assert (p.strategies["zero2"].micro_batch, p.strategies["zero2"].grad_accum) == (p.micro_batch, p.grad_accum)
    fits = lambda sp: sp.gpu_peak * RESERVED_OVER_ALLOCATED <= usable(80 * GiB)  # noqa: E731
    assert fits(p.strategies["zero2"])
    bigger = [m for m in micro_candidates(cfg, 1) if m > p.micro_batch]
    q = plan(cfg.model_copy(update={"micro_batch": bigger[0]}), gpu_memory_gb=80, strategies=("zero2",))
    assert not fits(q.strategies["zero2"])  # the next allowed micro batch is predicted not to fit


def test_auto_plans_each_strategy_at_its_own_micro_batch(capsys):
    """bloom-7b1 on one 80 GB GPU and a 125.9 GiB host, global batch 32: no in-memory strategy fits, so the configured
    strategy's (dp's) auto micro batch is 1. Each strategy gets its own: fsdp_offload the whole batch of 32 without
    accumulation (fits), ao_offload only micro 1 x 32 (accumulating, its fp32 gradients stay on the GPU: 67.4 GiB planned,
    69.0 while it was planned with DeepSpeed's ZeRO-3 buffers, which did not fit; larger micro batches add the compiled
    loss' logits), and ao_offload ranks first."""
    from shardlab.planning.planner import plan
    from shardlab.planning.render import render

    cfg = RunConfig(model="bloom-7b1", seq_len=1024, micro_batch="auto", global_batch=32, precision="bf16", gpus=1,
                    gradient_checkpointing=True)
    p = plan(cfg, gpu_memory_gb=79.2, host_ram_gb=125.9)
    s = p.strategies
    assert (p.micro_batch, p.grad_accum) == (1, 32) and not s["dp"].fits  # the header: the configured strategy's
    assert (s["fsdp_offload"].micro_batch, s["fsdp_offload"].grad_accum) == (32, 1) and s["fsdp_offload"].fits
    assert (s["ao_offload"].micro_batch, s["ao_offload"].grad_accum) == (1, 32) and s["ao_offload"].fits
    assert p.recommendation == "ao_offload" and p.next_option == "fsdp_offload"
    for name, sp in s.items():
        assert sp.micro_batch * sp.grad_accum == 32, name
    render(p)
    out = capsys.readouterr().out
    assert "micro x accum" in out and "Recommendation: ao_offload at micro 1 x accum 32" in " ".join(out.split())
    # with Liger's loss (no logits) ao_offload fits the whole batch, and only without accumulation
    q = plan(cfg.model_copy(update={"loss_kernel": "liger"}), gpu_memory_gb=79.2, host_ram_gb=125.9)
    ao = q.strategies["ao_offload"]
    assert (ao.micro_batch, ao.grad_accum) == (32, 1) and ao.fits
    assert q.recommendation == "ao_offload" and "measured" in q.reason and "not measured" not in q.reason
    half = plan(cfg.model_copy(update={"loss_kernel": "liger", "micro_batch": 16}), gpu_memory_gb=79.2, host_ram_gb=125.9,
                strategies=("ao_offload",)).strategies["ao_offload"]
    assert half.grad_accum == 2 and not half.fits  # not monotone: a bisection from micro 1 would never have tried 32


def test_fixed_micro_plans_every_strategy_at_it():
    cfg = RunConfig(model="gpt2", seq_len=256, micro_batch=4, grad_accum=2, precision="bf16", gpus=1)
    p = plan_for_all(cfg)
    assert not p.micro_auto and {(sp.micro_batch, sp.grad_accum) for n, sp in p.strategies.items()
                                 if n != "pipeline"} == {(4, 2)}


def plan_for_all(cfg):
    from shardlab.planning.planner import plan

    return plan(cfg, gpu_memory_gb=80, host_ram_gb=64)
