"""ParallelLayout (layout.py): the one owner of the data-parallel x pipeline layout.

Coordinates and process groups, the one-line refusals of shapes that cannot run, and every place that
reports a data-parallel size (launcher dry run, trainer, pipeline strategy, planner, bench matrix, the
strategies' data_parallel_size) agreeing with it. All in-process: no worker is started.
"""

from __future__ import annotations

import pytest
import yaml

from shardlab.config import RunConfig
from shardlab.errors import UserError
from shardlab.layout import LayoutError, ParallelLayout, data_parallel_size, model_layers


def pipe(**kw) -> RunConfig:
    """tiny-gpt2 under the pipeline strategy; pp_* keys are strategy options, the rest RunConfig fields."""
    opts = {k: v for k, v in kw.items() if k.startswith("pp_")}
    return RunConfig(model="tiny-gpt2", strategy="pipeline", strategy_options=opts, **{k: v for k, v in kw.items() if k not in opts})


# ---- coordinates and groups ---------------------------------------------------------------------------


def test_world_8_in_pipelines_of_2():
    lay = ParallelLayout.from_config(pipe(pp_stages=2, grad_accum=4), 8)
    assert (lay.stages, lay.chunks, lay.replicas, lay.dp_size, lay.microbatches) == (2, 1, 4, 4, 4)
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [lay.pp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert lay.pipeline_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.pipeline_group(5) == [4, 5] and lay.dp_group(5) == [1, 3, 5, 7]
    assert [lay.stages_of(r) for r in (0, 1)] == [[0], [1]]


def test_world_8_in_pipelines_of_4_interleaved_over_2_nodes():
    cfg = pipe(pp_stages=4, pp_schedule="interleaved-1f1b", pp_chunks=2, grad_accum=8, nodes=2)
    lay = ParallelLayout.from_config(cfg, 8, layers=8)
    assert (lay.stages, lay.chunks, lay.virtual_stages, lay.replicas, lay.nodes, lay.ranks_per_node) == (4, 2, 8, 2, 2, 4)
    assert lay.pipeline_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [lay.stages_of(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # loop-style, as torch's interleaved 1F1B
    assert lay.stages_of(6) == [2, 6] and lay.dp_rank(6) == 1 and lay.node(6) == 1


def test_zbv_places_two_stages_per_rank_in_a_v():
    """zbv: 2 stages per rank whatever --chunks says, rank p holding stages p and 2P-1-p (torch's style="v"), the first
    and the last stage on position 0; with replicas, each replica's ranks the same way. Any M (torch refuses none)."""
    cfg = pipe(pp_stages=3, pp_schedule="zbv", grad_accum=1)
    lay = ParallelLayout.from_config(cfg, 6, layers=6)
    assert (lay.stages, lay.chunks, lay.virtual_stages, lay.replicas, lay.placement) == (3, 2, 6, 2, "v")
    assert [lay.stages_of(r) for r in range(6)] == [[0, 5], [1, 4], [2, 3]] * 2
    assert [lay.stage_position(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError):
        ParallelLayout(world=2, stages=2, chunks=3, placement="v")  # a V has two legs


def test_one_rank_and_strategies_without_a_pipeline():
    one = ParallelLayout.from_config(pipe(grad_accum=2), 1)
    assert (one.stages, one.dp_size, one.pipeline_groups(), one.dp_groups(), one.stages_of(0)) == (1, 1, [[0]], [[0]], [0])
    for strategy in ("dp", "zero2", "fsdp", "zero3_offload"):
        # pipeline options of a config that does not pipeline change nothing
        cfg = RunConfig(model="tiny-gpt2", strategy=strategy, strategy_options={"pp_stages": 3, "pp_schedule": "interleaved-1f1b"})
        lay = ParallelLayout.from_config(cfg, 8)
        assert (lay.stages, lay.chunks, lay.dp_size) == (1, 1, 8) and data_parallel_size(cfg, 8) == 8
        assert [lay.dp_rank(r) for r in range(8)] == list(range(8)) and lay.dp_groups() == [list(range(8))]
    with pytest.raises(ValueError):
        ParallelLayout(world=6, stages=4)  # built directly, a broken shape is a bug, not a user error
    with pytest.raises(ValueError):
        ParallelLayout(world=2).dp_rank(2)


def test_micro_batches_follow_the_batch_triple():
    assert ParallelLayout.from_config(pipe(pp_stages=2, micro_batch=2, global_batch=32), 8).microbatches == 4  # 32 / (2 x 4 replicas)
    assert ParallelLayout.from_config(pipe(micro_batch="auto", grad_accum=4), 2).microbatches == 4
    assert ParallelLayout.from_config(pipe(micro_batch="auto"), 2).microbatches is None  # the trials decide it


# ---- refusals ---------------------------------------------------------------------------------------------


def one_line(err: UserError, *words: str) -> None:
    text = str(err)
    assert isinstance(err, LayoutError) and "\n" not in text and "(fix: " in text, text
    for w in words:
        assert w in text, f"{w!r} missing from {text}"


@pytest.mark.parametrize("cfg,world,layers,words", [
    (pipe(pp_stages=2), 3, None,
     ("3 processes cannot form pipelines of 2 stages", "multiple of --stages", "fix: use --stages dividing 3, or --gpus a multiple of 2")),
    (pipe(pp_stages=4), 8, 2, ("4 pipeline stages but tiny-gpt2 has only 2 layers", "use at most 2 stages (x chunks)")),
    (pipe(pp_schedule="interleaved-1f1b", grad_accum=4), 2, 2, ("4 pipeline stages", "only 2 layers")),
    (pipe(pp_schedule="zbv", grad_accum=4), 2, 3, ("zbv places 2 stages on each rank: 4 pipeline stages but tiny-gpt2 has only 3 layers",
                                                  "use at most 1 rank(s) per pipeline (--stages), or --schedule 1f1b")),
    (pipe(grad_accum=1), 2, None, ("1f1b needs at least one micro-batch per stage: 1 micro-batch(es) for 2 stages",
                                   "use --microbatches 4 (or at least 2), or --schedule gpipe")),
    (pipe(micro_batch=2, global_batch=2), 2, None, ("1 micro-batch(es) for 2 stages",)),
    (pipe(pp_schedule="interleaved-1f1b", pp_chunks=1, grad_accum=3), 2, 8,
     ("interleaved-1f1b needs the micro-batch count (3) divisible by the stages (2)", "use --microbatches 2")),
])
def test_every_bad_shape_is_one_line_with_its_fix(cfg, world, layers, words):
    with pytest.raises(LayoutError) as info:
        ParallelLayout.from_config(cfg, world, layers=layers)
    one_line(info.value, *words)


def test_what_a_plan_prices_and_words_differently():
    # GPUs, not processes, and no --gpus advice; any M is priced (pipesim runs it), `train` refuses it
    with pytest.raises(LayoutError) as info:
        ParallelLayout.from_config(pipe(pp_stages=2), 3, unit="GPUs")
    assert str(info.value).startswith("3 GPUs cannot form pipelines of 2 stages") and str(info.value).endswith("(fix: use --stages dividing 3)")
    lay = ParallelLayout.from_config(pipe(grad_accum=1), 2, microbatches=1, check_schedule=False)
    assert lay.microbatches == 1
    # another strategy's config, priced as a pipeline
    assert ParallelLayout.from_config(RunConfig(model="tiny-gpt2", gpus=4), 4, strategy="pipeline", check_schedule=False).stages == 4


def test_model_layers():
    from shardlab.training.models import build_hf_config

    assert model_layers(build_hf_config(RunConfig(model="tiny-gpt2"))) == 2
    assert model_layers(object()) is None


# ---- everyone agrees --------------------------------------------------------------------------------------


AGREE = [  # (strategy, gpus, strategy_options, extra RunConfig fields)
    ("dp", 8, {}, {}),
    ("zero2", 4, {}, {}),
    ("pipeline", 8, {"pp_stages": 2}, {}),
    ("pipeline", 8, {"pp_stages": 4}, {}),
    ("pipeline", 2, {"pp_schedule": "gpipe"}, {}),
]


@pytest.fixture(scope="module")
def deep_gpt2(tmp_path_factory):
    """A GPT-2 with 4 blocks: enough for 4 stages (tiny-gpt2 has 2)."""
    from transformers import GPT2Config

    path = tmp_path_factory.mktemp("gpt2-4") / "model"
    GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=1000, n_positions=128).save_pretrained(path)
    return str(path)


def agree_cfg(strategy, gpus, opts, extra, model) -> RunConfig:
    return RunConfig(model=model, strategy=strategy, gpus=gpus, device="cpu", seq_len=64, micro_batch=2, global_batch=32,
                     max_steps=1, strategy_options=opts, **extra)


@pytest.mark.parametrize("strategy,gpus,opts,extra", AGREE)
def test_launcher_trainer_strategy_planner_and_bench_agree(strategy, gpus, opts, extra, deep_gpt2, tmp_path, capsys, monkeypatch):
    import torch

    from shardlab.loop import trainer as trainer_mod
    from shardlab.bench.matrix import resolved_batch
    from shardlab.cli import main
    from shardlab.runtime.distributed import DistEnv
    from shardlab.planning.planner import plan
    from shardlab.strategies import strategy_class

    cfg = agree_cfg(strategy, gpus, opts, extra, deep_gpt2)
    lay = ParallelLayout.from_config(cfg, gpus, layers=4)
    triple = cfg.resolve_batch(lay.dp_size)
    assert triple[2] == 32 and triple[0] * triple[1] * lay.dp_size == 32

    # the strategies' own answer (cli dry run, slurm, autobatch ask it)
    assert strategy_class(strategy).data_parallel_size(cfg, gpus) == lay.dp_size

    # launcher: the dry run prints the triple preflight resolved
    monkeypatch.chdir(tmp_path)
    for var in ("DS_ACCELERATOR", "PYTHONWARNINGS"):  # the launcher sets these for its workers; restored after
        monkeypatch.delenv(var, raising=False)
    argv = ["train", "--model", deep_gpt2, "--strategy", strategy, "--gpus", str(gpus), "--device", "cpu", "--seq-len", "64",
            "--micro-batch", "2", "--global-batch", "32", "--max-steps", "1", "--output-dir", str(tmp_path / "run"), "--dry-run"]
    for key, value in opts.items():
        argv += ["--set", f"strategy_options.{key}={value}"]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    out = yaml.safe_load(capsys.readouterr().out.split("# DeepSpeed config")[0])
    assert (out["micro_batch"], out["grad_accum"], out["global_batch"]) == triple

    # trainer, on every rank: its sampler's dp size and rank are the layout's
    for rank in range(gpus):
        env = DistEnv(rank=rank, world_size=gpus, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        monkeypatch.setattr(trainer_mod, "init_distributed", lambda *a, _env=env, **k: _env)
        t = trainer_mod.Trainer(cfg)
        assert (t.dp_size, t.dp_rank, (t.micro, t.accum, t.global_batch)) == (lay.dp_size, lay.dp_rank(rank), triple)
        assert t.layout["dp_size"] == lay.dp_size  # what checkpoints record

    # planner: the batch it plans, and the pipeline row's replicas
    p = plan(cfg, gpu_memory_gb=80, strategies=(strategy,), max_search=4)
    assert (p.micro_batch, p.grad_accum) == triple[:2]
    if strategy == "pipeline":
        assert f"{lay.stages} GPU(s) per pipeline x {lay.replicas} replica(s), {lay.microbatches} micro-batches" in p.strategies[strategy].notes[0]

    # bench matrix
    assert resolved_batch({"model": deep_gpt2, "strategy": strategy, "gpus": gpus, "micro_batch": 2, "global_batch": 32,
                           "strategy_options": opts, **extra}) == triple


def test_pipeline_strategy_groups_are_the_layouts(monkeypatch):
    """The groups _make_groups creates, in creation order (torch needs every rank to create every group alike)."""
    import torch

    import shardlab.strategies.pipeline as pipeline
    from shardlab.runtime.distributed import DistEnv
    from shardlab.runtime.resolved import resolve_precision

    made = []
    monkeypatch.setattr(pipeline.dist, "new_group", lambda ranks: made.append(list(ranks)) or tuple(ranks))
    cfg = pipe(pp_stages=2, grad_accum=4)
    lay = ParallelLayout.from_config(cfg, 8)
    for rank in range(8):
        made.clear()
        env = DistEnv(rank=rank, world_size=8, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        s = pipeline.PipelineStrategy(cfg, env, resolve_precision("fp32", "cpu"), 4, 8)
        s.parallel = lay
        s._make_groups()
        assert made == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2, 4, 6], [1, 3, 5, 7]]
        assert (s.pp_rank, s.dp_rank, s.dp_size, s.pp_ranks) == (rank % 2, rank // 2, 4, lay.pipeline_group(rank))
        assert s.pp_group == tuple(lay.pipeline_group(rank)) and s.dp_group == tuple(lay.dp_group(rank))
