"""`--strategy pipeline` on CPU (gloo, 2 ranks): the same per-step losses as dp, export, resume, errors.

dp runs on one rank with --grad-accum M, the pipeline on 2 ranks with M micro-batches: the same global
batch, the same data order (pipeline stages share one data-parallel rank), fp32, dropout 0.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from shardlab.strategies.pipeline import stage_costs

ARGS = ["--max-steps", "10", "--micro-batch", "2", "--grad-accum", "2", "--seq-len", "64", "--lr", "1e-3",
        "--dropout", "0", "--precision", "fp32", "--log-every", "1", "--seed", "7", "--set", "dataset.eval_samples=1"]  # fmt: skip


def assert_same_losses(run, ref, rel=1e-3):
    run.check(), ref.check()
    assert len(run.losses) == len(ref.losses) == 10
    assert run.losses == pytest.approx(ref.losses, rel=rel)
    assert run.losses[-1] < run.losses[0]


def check_measured_vs_simulated(pp: dict, schedule: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """The run's own per-(virtual-)stage times, fed to the simulator, give the simulated figures it reports; a rank's
    times are the sum of its stages' (under zbv each backward is its I and W, and W's share is fed as wgrad)."""
    from shardlab.pipesim import simulate

    assert (pp["schedule"], pp["stages"], pp["microbatches"]) == (schedule, stages, microbatches)
    fwd, bwd = pp["stage_fwd_ms"], pp["stage_bwd_ms"]
    assert len(fwd) == len(bwd) == stages and min(fwd) > 0 and min(bwd) > 0
    vf, vb = pp["virtual_stage_fwd_ms"], pp["virtual_stage_bwd_ms"]
    assert len(vf) == len(vb) == stages * chunks and min(vf) > 0 and min(vb) > 0
    for rank, mine in enumerate(pp["stages_of_rank"]):
        assert fwd[rank] == pytest.approx(sum(vf[s] for s in mine)) and bwd[rank] == pytest.approx(sum(vb[s] for s in mine))
    wgrad = None
    if schedule == "zbv":
        w = pp["virtual_stage_wgrad_ms"]
        assert all(0 < x <= b for x, b in zip(w, vb))
        wgrad = [min(1.0, x / b) for x, b in zip(w, vb)]
    sim = simulate(schedule, stages, microbatches, fwd=vf, bwd=vb, chunks=chunks, wgrad=wgrad)
    assert pp["simulated_step_ms"] == pytest.approx(sim.makespan, rel=1e-9)
    assert pp["simulated_bubble"] == pytest.approx(sim.metrics["bubble_fraction"], rel=1e-9)
    # the step is the pipeline's (first stage's start to the last rank's end), each rank's end within it
    assert max(pp["simulated_rank_end_ms"]) == pytest.approx(sim.makespan, rel=1e-9)
    ends = pp["measured_rank_end_ms"]  # one host: the ranks share a clock
    assert len(ends) == stages and all(0 < e <= 1.01 * pp["measured_step_ms"] for e in ends)
    # Each rank runs its forwards and backwards one after another inside the schedule's step, so the
    # measured step is at least the busiest rank's work, and so is the simulated one.
    busiest = max(microbatches * (f + b) for f, b in zip(fwd, bwd))
    assert pp["measured_step_ms"] >= 0.99 * busiest and pp["simulated_step_ms"] >= 0.99 * busiest
    assert 0 <= pp["measured_bubble"] < 1 and 0 < pp["simulated_bubble"] < 1


@pytest.fixture
def root(tmp_path):
    return tmp_path


DP_GPT2 = ["--model", "tiny-gpt2", "--strategy", "dp", *ARGS, "--save-every", "5"]  # its step 5 resumes as a pipeline


def pp_gpt2(schedule: str) -> list[str]:
    return ["--model", "tiny-gpt2", "--strategy", "pipeline", "--gpus", "2", "--schedule", schedule, *ARGS, "--save-every", "5"]


@pytest.fixture
def dp_gpt2(shared_runs):
    return shared_runs.get(DP_GPT2, name="dp-gpt2")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt2_pipeline_matches_dp(shared_runs, dp_gpt2, schedule):
    run = shared_runs.get(pp_gpt2(schedule), name=f"pp-{schedule}")
    assert_same_losses(run, dp_gpt2)
    assert run.summary["world_size"] == 2 and run.summary["global_batch"] == 4
    check_measured_vs_simulated(run.summary["pipeline"], schedule, stages=2, microbatches=2)
    assert "stage_timer" in run.summary["patches"]  # the per-stage times come from compat/stage_timer.py
    # The export gathers both stages (embedding and head included) into one HF model equal to dp's.
    pp, dp = (AutoModelForCausalLM.from_pretrained(r.out / "model").state_dict() for r in (run, dp_gpt2))
    assert pp.keys() == dp.keys()
    for name in dp:
        torch.testing.assert_close(pp[name], dp[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow
def test_pipeline_resume_reproduces_the_run(root, shared_runs, train_cli):
    first = shared_runs.get(pp_gpt2("1f1b"), name="pp-1f1b").check()
    run = train_cli(["--model", "tiny-gpt2", "--strategy", "pipeline", "--gpus", "2", "--schedule", "1f1b", *ARGS,
                     "--resume", str(first.out / "checkpoints" / "step-0000005")], root / "pp-resumed")  # fmt: skip
    run.check()
    original = first.losses
    assert [r["step"] for r in run.rows] == list(range(6, 11))
    assert run.losses == pytest.approx(original[5:], rel=1e-5)


# ---- resume across strategies: a pipeline checkpoint is a dp checkpoint (DCP, the model's own names) -------------


def max_rel_diff(losses, ref) -> float:
    assert len(losses) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


RESUMED_AS = {  # the same global batch (4) as the pipeline's 2 micro-batches of 2
    "dp-1rank": ["--strategy", "dp"],
    "fsdp-2rank": ["--strategy", "fsdp", "--gpus", "2", "--grad-accum", "1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED_AS))
def test_pipeline_checkpoint_resumes_as_dp_and_fsdp(root, shared_runs, dp_gpt2, train_cli, name):
    """The 2-stage pipeline's step-5 checkpoint, resumed as dp on 1 rank and fsdp on 2 (no conversion: the same DCP
    layout), continues the pipeline run: steps 6-10 within 1e-4 relative of the uninterrupted pipeline run's, and of
    the uninterrupted dp run's (pipeline and dp agree that closely on fp32 CPU)."""
    first = shared_runs.get(pp_gpt2("1f1b"), name="pp-1f1b").check()
    run = train_cli(["--model", "tiny-gpt2", *ARGS, *RESUMED_AS[name], "--no-export",
                     "--resume", str(first.out / "checkpoints" / "step-0000005")], root / f"{name}-from-pp")  # fmt: skip
    run.check()
    assert "resumed from" in run.stdout
    assert [r["step"] for r in run.rows] == list(range(6, 11))
    print(f"{name} from pipeline step 5: max rel diff {max_rel_diff(run.losses, first.losses[5:]):.2e} vs the pipeline run, "
          f"{max_rel_diff(run.losses, dp_gpt2.losses[5:]):.2e} vs dp")  # fmt: skip
    assert run.losses == pytest.approx(first.losses[5:], rel=1e-4)
    assert run.losses == pytest.approx(dp_gpt2.losses[5:], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["dp", "fsdp"])
def test_a_dp_or_fsdp_checkpoint_resumes_as_pipeline(root, shared_runs, dp_gpt2, train_cli, source):
    """dp's (1 rank) or fsdp's (2 ranks) step-5 checkpoint, resumed as a 2-stage pipeline on 2 ranks: each stage
    reads its tensors by their names in the whole model (the tied embedding too, on the first and the last stage);
    steps 6-10 within 1e-4 relative of the uninterrupted dp and pipeline runs. With the pipeline -> dp/fsdp test
    above, checkpoints go both ways between the pipeline and the data-parallel strategies."""
    straight = shared_runs.get(pp_gpt2("1f1b"), name="pp-1f1b").check()
    dp_gpt2.check()
    first = dp_gpt2 if source == "dp" else shared_runs.get(
        ["--model", "tiny-gpt2", *ARGS, *RESUMED_AS["fsdp-2rank"], "--save-every", "5", "--no-export"], name="fsdp-gpt2").check()
    run = train_cli(["--model", "tiny-gpt2", "--strategy", "pipeline", "--gpus", "2", "--schedule", "1f1b", *ARGS, "--no-export",
                     "--resume", str(first.out / "checkpoints" / "step-0000005")], root / f"pp-from-{source}")  # fmt: skip
    run.check()
    assert [r["step"] for r in run.rows] == list(range(6, 11))
    print(f"pipeline from {source} step 5: max rel diff {max_rel_diff(run.losses, dp_gpt2.losses[5:]):.2e} vs dp, "
          f"{max_rel_diff(run.losses, straight.losses[5:]):.2e} vs the pipeline run")  # fmt: skip
    assert run.losses == pytest.approx(dp_gpt2.losses[5:], rel=1e-4)
    assert run.losses == pytest.approx(straight.losses[5:], rel=1e-4)


@pytest.mark.slow
def test_bloom_pipeline_matches_dp(root, train_cli):
    dp = train_cli(["--model", "tiny-bloom", "--strategy", "dp", *ARGS, "--no-export"], root / "dp-bloom")
    pp = train_cli(["--model", "tiny-bloom", "--strategy", "pipeline", "--gpus", "2", *ARGS, "--no-export"], root / "pp-bloom")
    assert_same_losses(pp, dp)


@pytest.mark.slow
def test_bf16_pipeline_trains_like_dp_in_bf16(root, train_cli):
    """A bf16 pipeline run follows dp's bf16 run. (That its stages really compute in bf16 is the next test's:
    how far bf16 moves tiny-gpt2's near-uniform initial loss depends on the CPU's bf16 kernels.)"""
    bf16 = [a if a != "fp32" else "bf16" for a in ARGS] + ["--no-export", "--max-steps", "4"]
    dp = train_cli(["--model", "tiny-gpt2", "--strategy", "dp", *bf16], root / "dp-bf16")
    dp.check()
    pp = train_cli(["--model", "tiny-gpt2", "--strategy", "pipeline", "--gpus", "2", *bf16], root / "pp-bf16")
    pp.check()
    assert pp.summary["precision"] == "bf16"
    # A few eval samples cannot fill one pipeline eval batch (micro x micro-batches): no eval, not a fake loss of 0.
    assert pp.summary["final_eval_loss"] is None and "no eval: " in pp.stdout
    assert pp.losses == pytest.approx(dp.losses, rel=2e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_pipeline_stages_compute_in_the_runs_precision(monkeypatch, precision):
    """The stages the strategy builds run their matmuls under bf16 autocast over fp32 weights (fp32: no autocast),
    checked on the dtypes of every matmul's output, which no CPU model changes. The strategy is built in-process up
    to its first torch PipelineStage (which needs a process group), where the stage module is caught."""
    import torch.distributed.pipelining as pipelining

    from shardlab.config import RunConfig
    from shardlab.runtime.distributed import DistEnv
    from shardlab.training.models import build_model
    from shardlab.runtime.resolved import Precision
    from shardlab.strategies import strategy_class

    class Built(Exception):
        pass

    def catch(module, *args, **kwargs):
        raise Built(module)

    monkeypatch.setattr(pipelining, "PipelineStage", catch)
    cfg = RunConfig(model="tiny-gpt2", strategy="pipeline", precision=precision, dropout=0.0)
    env = DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo")  # the last stage: blocks and head
    strategy = strategy_class("pipeline")(cfg, env, Precision(precision), 2, 2)
    with pytest.raises(Built) as built:
        strategy.setup(build_model(cfg), 10)
    stage = built.value.args[0]
    assert stage.head is not None and len(stage.blocks) > 0
    matmul_outputs = []
    for module in stage.modules():
        if not list(module.children()) and any(p.dim() == 2 for p in module.parameters(recurse=False)):
            module.register_forward_hook(lambda mod, args, out: matmul_outputs.append(out.dtype))
    logits = stage(torch.randn(2, 8, stage.config.n_embd))
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert len(matmul_outputs) == 4 * len(stage.blocks) + 1  # attention qkv and proj, two MLP layers per block; the head
    assert set(matmul_outputs) == {want} and logits.dtype == want
    assert all(p.dtype == torch.float32 for p in stage.parameters())  # fp32 master weights under autocast


@pytest.mark.slow
def test_interleaved_1f1b_matches_dp(root, train_cli, dp_4_layers):
    model, dp = dp_4_layers  # interleaving 2 chunks on 2 ranks needs 4 layers
    args = ["--model", model, *ARGS, "--grad-accum", "4", "--no-export"]
    pp = train_cli([*args, "--strategy", "pipeline", "--gpus", "2", "--schedule", "interleaved-1f1b", "--chunks", "2"], root / "pp-4l")
    assert_same_losses(pp, dp)
    assert "4 stages over 2 ranks" in pp.stdout
    check_measured_vs_simulated(pp.summary["pipeline"], "interleaved-1f1b", stages=2, microbatches=4, chunks=2)


def gpt2_layers(path, n_layer: int):
    """A small GPT-2 with `n_layer` blocks (tied embeddings, as GPT-2's), saved with the offline BPE tokenizer."""
    from shardlab.training.tokenizing import gpt2_bpe_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=n_layer, n_embd=64, n_head=4)).save_pretrained(path)
    gpt2_bpe_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def dp_4_layers(shared_runs):
    """A 4-layer GPT-2 (gpt2_layers) and dp's run on it at M = 4, built and trained once per pytest run for every xdist
    worker (conftest.SharedRuns): the reference of the interleaved and the zbv schedules."""
    model = shared_runs.root / "gpt2-4-layers"
    args = ["--model", str(model), *ARGS, "--grad-accum", "4", "--strategy", "dp"]
    return str(model), shared_runs.get(args, name="dp-4l", prepare=lambda: gpt2_layers(model, 4))


@pytest.mark.slow
def test_zbv_matches_dp_and_1f1b(root, train_cli, dp_4_layers):
    """zbv (torch's ScheduleZBVZeroBubble) on 2 ranks: 4 stages in a V (rank 0 runs the first and the last, so the tied
    embedding is one Parameter in two of its stages), each backward split into I and W. With M = 4 it follows dp, exports
    dp's model and resumes from its own checkpoint; with M = 2 (fewer than torch's planned 2P-1 = 3 micro-batches: it
    drops the rest) it follows 1F1B at M = 2."""
    model, dp = dp_4_layers  # 2 stages per rank on 2 ranks need 4 layers
    args = ["--model", model, *ARGS, "--grad-accum", "4"]
    zbv_args = [*args, "--strategy", "pipeline", "--gpus", "2", "--schedule", "zbv"]
    pp = train_cli([*zbv_args, "--save-every", "5"], root / "zbv-4l")
    assert_same_losses(pp, dp)
    assert "4 stages over 2 ranks in a V" in pp.stdout
    assert pp.summary["pipeline"]["stages_of_rank"] == [[0, 3], [1, 2]]
    check_measured_vs_simulated(pp.summary["pipeline"], "zbv", stages=2, microbatches=4, chunks=2)
    assert [r["grad_norm"] for r in pp.rows] == pytest.approx([r["grad_norm"] for r in dp.rows], rel=1e-3)  # tied grad scaled once
    exported, ref = (AutoModelForCausalLM.from_pretrained(r.out / "model").state_dict() for r in (pp, dp))
    assert exported.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(exported[name], ref[name], rtol=1e-3, atol=1e-5, msg=name)
    resumed = train_cli([*zbv_args, "--no-export", "--resume", str(pp.out / "checkpoints" / "step-0000005")], root / "zbv-4l-resumed")
    resumed.check()
    assert [r["step"] for r in resumed.rows] == list(range(6, 11))
    assert resumed.losses == pytest.approx(pp.losses[5:], rel=1e-5)
    two = [*args[:-1], "2", "--no-export", "--strategy", "pipeline", "--gpus", "2"]  # --grad-accum 2
    one_f = train_cli([*two, "--schedule", "1f1b"], root / "1f1b-4l-m2")
    zbv2 = train_cli([*two, "--schedule", "zbv"], root / "zbv-4l-m2")
    assert_same_losses(zbv2, one_f)
    check_measured_vs_simulated(zbv2.summary["pipeline"], "zbv", stages=2, microbatches=2, chunks=2)


@pytest.mark.slow
def test_zbv_on_three_ranks_matches_dp(root, train_cli):
    """3 ranks, 6 stages in a V (rank r: stages r and 5-r; the turn of the V, stages 2 and 3, on rank 2), M = 6."""
    model = str(gpt2_layers(root / "gpt2-6-layers", 6))
    args = ["--model", model, *ARGS, "--grad-accum", "6", "--max-steps", "4", "--no-export"]
    dp = train_cli([*args, "--strategy", "dp"], root / "dp-6l")
    pp = train_cli([*args, "--strategy", "pipeline", "--gpus", "3", "--schedule", "zbv"], root / "zbv-6l")
    dp.check(), pp.check()
    assert len(pp.losses) == len(dp.losses) == 4
    assert pp.losses == pytest.approx(dp.losses, rel=1e-3)
    assert pp.summary["pipeline"]["stages_of_rank"] == [[0, 5], [1, 4], [2, 3]]
    check_measured_vs_simulated(pp.summary["pipeline"], "zbv", stages=3, microbatches=6, chunks=2)


def test_zbv_refused_where_torch_lacks_it(monkeypatch):
    """On a torch without ScheduleZBVZeroBubble, --schedule zbv is one line before any worker starts; --chunks is
    refused with zbv (it always has 2)."""
    import shardlab.strategies.pipeline as strategy
    from shardlab.config import RunConfig
    from shardlab.errors import UserError

    cfg = RunConfig(model="tiny-gpt2", strategy="pipeline", strategy_options={"pp_schedule": "zbv"})
    from shardlab.runtime.resolved import assumed_run

    strategy.PipelineStrategy.check_options(assumed_run(cfg, "cpu", world=1, accum=2))
    with pytest.raises(UserError, match="--chunks 3"):
        strategy.PipelineStrategy.check_options(assumed_run(cfg.model_copy(update={"strategy_options": cfg.strategy_options.model_copy(
            update={"pp_chunks": 3}, deep=True)}), "cpu", world=1, accum=2))
    monkeypatch.setattr(strategy, "zbv_schedule_class", lambda: None)
    with pytest.raises(UserError, match="needs torch's ScheduleZBVZeroBubble"):
        strategy.PipelineStrategy.check_options(assumed_run(cfg, "cpu", world=1, accum=2))


@pytest.mark.slow
def test_pipeline_with_data_parallel_replicas_matches_dp(root, train_cli):
    """4 ranks = 2 pipeline replicas x 2 stages, against dp on 2 ranks: same global batch and data shards."""
    dp = train_cli(["--model", "tiny-gpt2", "--strategy", "dp", "--gpus", "2", *ARGS, "--no-export"], root / "dp2-gpt2")
    pp = train_cli(["--model", "tiny-gpt2", "--strategy", "pipeline", "--gpus", "4", "--stages", "2", *ARGS, "--no-export"],
                   root / "pp2x2-gpt2")  # fmt: skip
    assert_same_losses(pp, dp)
    assert pp.summary["world_size"] == 4 and pp.summary["global_batch"] == dp.summary["global_batch"] == 8
    assert [r["grad_norm"] for r in pp.rows] == pytest.approx([r["grad_norm"] for r in dp.rows], rel=1e-3)


def test_split_balances_compute_with_the_head_on_the_last_stage():
    # Equal layers, no head: an even split.
    assert stage_costs(8, 1.0, 0.0, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # bloom-560m-like: the 250k-vocabulary head costs ~20 layers, so the last stage gets few blocks.
    bounds = stage_costs(24, 1.0, 20.0, 2)
    assert bounds[0][0] == 0 and bounds[-1][1] == 24 and bounds[0][1] == bounds[1][0]
    assert bounds[1][1] - bounds[1][0] == 2  # 22 blocks vs 2 blocks + head: max(22, 22)
    with pytest.raises(ValueError, match="only 2 layers"):  # the user meets ParallelLayout's LayoutError first
        stage_costs(2, 1.0, 0.0, 3)


def recorded(tl, starts: list[float], clock0: float = 0.0) -> list[tuple[float, float, float]]:
    """What each rank's train_step records of a simulated step: (start, end, work) on the shared clock, where rank d
    entered the step at ``starts[d]`` (before its first input arrives: it only waits) and ends with its last action."""
    return [(clock0 + starts[d], clock0 + max(e.end for e in tl.device_events(d)), sum(e.duration for e in tl.device_events(d)))
            for d in range(tl.stages)]


def test_measured_zbv_step_is_the_last_ranks_end_not_the_first_ranks():
    """Under zbv on 2 ranks the first stage's rank (0) is done once the last input gradient reaches it, while rank 1
    still runs its deferred W's: the step ends with rank 1. With the H200 gpt2-large times (ms per micro-batch, M = 8)
    rank 0's own step is 858.5 (the 850 measured once as 'the step') and the pipeline's 925; the accounting gives the
    simulator's step and bubble from what the ranks record, whatever the ranks' clocks read and wherever a rank entered."""
    from shardlab.pipesim import simulate
    from shardlab.strategies.pipeline import pipeline_step

    fwd, bwd, w = [12.2, 11.9, 12.5, 11.1], [21.7, 45.4, 44.3, 17.9], [21.7, 30.0, 28.2, 7.8]
    tl = simulate("zbv", 2, 8, fwd=fwd, bwd=bwd, wgrad=[x / b for x, b in zip(w, bwd)])
    steps = [recorded(tl, [0.0, 3.0], clock0=5000.0), recorded(tl, [0.0, -4.0], clock0=9000.0)]  # rank 1 late, early
    ranks = [[step[r] for step in steps] for r in range(2)]
    got = pipeline_step(ranks, first=0, shared_clock=True)
    assert got["step"] == pytest.approx(tl.makespan) and tl.makespan == pytest.approx(925.0)
    assert got["bubble"] == pytest.approx(tl.metrics["bubble_fraction"])
    assert got["rank_end"] == pytest.approx([858.5, 925.0])  # rank 0 ends 66.5 ms early
    # without a shared clock the slowest rank's own step is all there is: off by when rank 1 entered, either way
    own = [pipeline_step([[r[i]] for r in ranks], first=0, shared_clock=False)["step"] for i in range(2)]
    assert own == pytest.approx([925.0 - 3.0, 925.0 + 4.0])


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_measured_step_and_bubble_are_the_simulators(schedule, chunks):
    """Fed the ranks' records of a simulated step (unequal stages, 3 ranks), the measured step and bubble are the
    simulated makespan and bubble: both sides define them alike (last end - first stage's start; 1 - work / (P x step))."""
    from shardlab.pipesim import simulate
    from shardlab.strategies.pipeline import pipeline_step

    n = 3 * chunks
    fwd, bwd = [1.0 + 0.3 * s for s in range(n)], [2.5 - 0.2 * s for s in range(n)]
    tl = simulate(schedule, 3, 6, fwd=fwd, bwd=bwd, chunks=chunks, wgrad=0.4 if schedule == "zbv" else None)
    got = pipeline_step([[r] for r in recorded(tl, [0.0, 0.5, 0.2])], first=0, shared_clock=True)
    assert got["step"] == pytest.approx(tl.makespan)
    assert got["bubble"] == pytest.approx(tl.metrics["bubble_fraction"])


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--gpus", "3", "--stages", "2"], ("cannot form pipelines of 2 stages",)),
        (["--gpus", "2", "--schedule", "interleaved-1f1b", "--grad-accum", "3"], ("only 2 layers",)),
        (["--gpus", "4"], ("4 pipeline stages", "only 2 layers")),
        (["--gpus", "2", "--schedule", "zigzag"], ("pp_schedule",)),
        (["--gpus", "2", "--schedule", "zbv"], ("zbv places 2 stages on each rank", "4 pipeline stages", "only 2 layers")),
        (["--gpus", "1", "--schedule", "zbv", "--chunks", "3"], ("zbv always places 2 stages on each rank, not --chunks 3",)),
    ],
)
def test_pipeline_bad_inputs(tmp_path, monkeypatch, capsys, extra, words):
    """Refused by the launcher before any worker starts: called in-process (a fresh interpreter per case would
    cost more than the check)."""
    from shardlab.cli import main

    for var in ("DS_ACCELERATOR", "PYTHONWARNINGS"):  # the launcher sets these for its workers; restored after
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-gpt2", "--strategy", "pipeline", "--max-steps", "2", *extra, "--output-dir", str(out)])
    stderr = capsys.readouterr().err
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    for w in words:
        assert w in lines[0]
    assert not out.exists()


def test_pipeline_refuses_fp16_on_gpus(monkeypatch):
    from shardlab.config import RunConfig
    from shardlab.errors import UserError
    from shardlab.strategies import strategy_class

    from shardlab.runtime.resolved import assumed_run

    cfg = RunConfig(model="tiny-gpt2", strategy="pipeline", precision="fp16")
    with pytest.raises(UserError, match="fp16 is not supported with strategy 'pipeline'"):
        strategy_class("pipeline").check_options(assumed_run(cfg, "cuda", world=2, accum=2))
    strategy_class("pipeline").check_options(assumed_run(cfg.model_copy(update={"precision": "bf16", "grad_accum": 2}), "cuda", world=2, accum=2))


@pytest.mark.slow
def test_pipeline_vs_zero_page_from_run_dirs(shared_runs, tmp_path):
    """benchmarks/pipeline_vs_zero.py reads finished runs (never re-trains) and flags unequal comparisons."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    runs = []
    for name, args in (("pp-1f1b", pp_gpt2("1f1b")), ("dp-gpt2", DP_GPT2)):  # the page labels runs by directory name
        (tmp_path / name).symlink_to(shared_runs.get(args, name=name).check().out)
        runs.append(tmp_path / name)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_vs_zero.py"
    out = tmp_path / "page.md"
    proc = subprocess.run([sys.executable, str(script), *map(str, runs), str(tmp_path / "unfinished"),
                           "--out", str(out), "--json", str(tmp_path / "rows.json")], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    pp = json.loads((runs[0] / "summary.json").read_text())["pipeline"]
    assert "| pp-1f1b | pipeline | 2 | 1f1b (2) |" in text
    assert f"{pp['measured_step_ms']:.0f} / {pp['simulated_step_ms']:.0f}" in text
    assert "| dp-gpt2 | dp | 1 | - |" in text
    assert "Not finished (no summary.json)" in text  # the unfinished directory is named, not silently dropped
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["strategy"] for r in rows] == ["pipeline", "dp"]


# ---- checkpoints: the stages' tensors under the unsplit model's names (DCP, the layout dp writes) ----------------


@pytest.mark.parametrize("preset,blocks", [("tiny-gpt2", "transformer.h"), ("tiny-bloom", "transformer.h"), ("tiny-llama", "model.layers")])
def test_stage_names_map_to_the_models_own_names(preset, blocks):
    """Each rank's stages (built as the strategy builds them: rank r holds stages r, r+2, ...) name their tensors
    '0.blocks.0...' etc.; hf_names maps them back by identity. Over the ranks every state_dict name of the HF
    model is covered once by some stage tensor, with its shape; block indices are the model's, not the stage's;
    the last stage's tied LM head carries the embedding's name first (what dp keys its optimizer state by)."""
    from torch import nn

    from shardlab.config import RunConfig
    from shardlab.training.models import build_model
    from shardlab.strategies.pipeline import model_parts, Stage, hf_names

    model = build_model(RunConfig(model=preset, dropout=0.0))
    n_layers = len(model_parts(model)[2])
    full = model.state_dict(keep_vars=True)
    first_names = list(dict(model.named_parameters()))  # what DCP's get_state_dict keys a dp optimizer state by
    for n_ranks, chunks in ((2, 1), (1, 1), (2, n_layers // 2)):
        n_stages = n_ranks * chunks
        bounds = [(s * n_layers // n_stages, (s + 1) * n_layers // n_stages) for s in range(n_stages)]
        covered: dict[str, torch.Size] = {}
        for rank in range(n_ranks):
            mine = [s for s in range(n_stages) if s % n_ranks == rank]
            stages = nn.ModuleList(Stage(model, *bounds[s], first=s == 0, last=s == n_stages - 1) for s in mine)
            names = hf_names(model, stages)
            local = stages.state_dict()
            assert names.keys() == local.keys()
            for name, hf in names.items():
                assert hf and all(full[h] is full[hf[0]] for h in hf), (name, hf)
                assert local[name].shape == full[hf[0]].shape
                if name in dict(stages.named_parameters()):
                    assert hf[0] in first_names, (name, hf)  # a parameter's first name is the canonical one
                covered.update((h, local[name].shape) for h in hf)
                for pos, s in enumerate(mine):  # '<pos>.blocks.<i>.' is block bounds[s][0] + i of the model
                    prefix = f"{pos}.blocks."
                    if name.startswith(prefix):
                        i = int(name.removeprefix(prefix).split(".")[0])
                        assert hf[0].startswith(f"{blocks}.{bounds[s][0] + i}."), (name, hf)
                        assert hf[0].removeprefix(f"{blocks}.{bounds[s][0] + i}.") == name.removeprefix(f"{prefix}{i}.")
        assert covered == {k: v.shape for k, v in full.items()}
        if n_ranks == 2 and chunks == 1:
            head = {n: hf for n, hf in names.items() if n.startswith("0.head.lm_head.")}  # rank 1's names: the last stage
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            assert head["0.head.lm_head.weight"] == ([first_names[0], "lm_head.weight"] if tied else ["lm_head.weight"])
