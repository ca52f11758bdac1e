"""A newcomer's mistakes (issue 12, section 3): one line naming the problem and the fix, a non-zero exit, and
nothing written; or the right behaviour, said in the log.

The error paths are checked in-process through `shardlab.cli.main` (they fire before any worker exists), in a
fresh working directory each, so "nothing written" means the directory is still empty.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from zygote import run_shardlab

from shardlab.cli import main


def run_cli(argv: list[str], cwd: Path, capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    capsys.readouterr()  # drop what earlier steps printed
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str, *words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(fix: " in lines[0], err
    for word in words:
        assert word.lower() in lines[0].lower(), f"{word!r} missing from: {lines[0]}"
    return lines[0]


def assert_error(argv: list[str], tmp_path: Path, capsys, monkeypatch, *words: str) -> str:
    """`shardlab ARGV` in an empty directory: exit 2, one error line with `words`, the directory still empty."""
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    before = sorted(os.listdir(work))
    code, _, err = run_cli(argv, work, capsys, monkeypatch)
    assert code == 2, err
    line = one_error_line(err, *words)
    assert sorted(os.listdir(work)) == before, f"{argv} wrote {sorted(os.listdir(work))}"
    return line


# ---- 7. plan: the model first ---------------------------------------------------------------------------


def test_plan_unknown_model_is_reported_before_a_missing_gpu(tmp_path, capsys, monkeypatch):
    # No --gpu-memory-gb and (here) no GPU: the model is still the first problem named.
    assert_error(["plan", "--model", "no-such-model"], tmp_path, capsys, monkeypatch, "no-such-model", "not available offline")
    assert_error(["plan", "--model", "gpt2-mediun"], tmp_path, capsys, monkeypatch, "did you mean", "gpt2-medium")


# ---- 8. YAML: tabs, and every unknown key -------------------------------------------------------------


def test_tab_indented_yaml_names_the_tab_and_where(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: tiny-gpt2\ndataset:\n\tsource: offline\n")
    line = assert_error(["train", "--config", str(cfg)], tmp_path, capsys, monkeypatch, "tab", "line 3:1", "spaces")
    assert "run.yaml" in line


def test_every_unknown_config_key_is_reported_at_once(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: tiny-gpt2\nmicro_batchsize: 2\nlearning_rate: 1.0e-4\ndataset:\n  sorce: offline\n")
    line = assert_error(["train", "--config", str(cfg)], tmp_path, capsys, monkeypatch,
                        "3 unknown config keys", "'micro_batchsize'", "'learning_rate'", "'dataset.sorce'")
    assert "did you mean 'micro_batch'?" in line and "did you mean 'dataset.source'?" in line
    # one unknown key keeps the short form
    assert_error(["train", "--set", "strategy_options.pin_mem=false"], tmp_path, capsys, monkeypatch,
                 "unknown config key 'strategy_options.pin_mem'", "did you mean 'strategy_options.pin_memory'?")


# ---- 9. --gpus 0: one rule for every command ----------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["train", "--gpus", "0", "--max-steps", "1"],
    ["train", "--gpus", "0", "--device", "cpu", "--dry-run"],
    ["plan", "--gpus", "0", "--gpu-memory-gb", "80"],
    ["slurm", "--gpus", "0", "--nodes", "2"],
    ["bench", "--gpus", "0,1", "--dry-run"],
])  # fmt: skip
def test_gpus_zero_is_refused_by_every_command(argv, tmp_path, capsys, monkeypatch):
    assert_error(argv, tmp_path, capsys, monkeypatch, "gpus 0", "at least 1", "--device cpu")


# ---- 1. pipeline without --microbatches ---------------------------------------------------------------


def test_pipeline_without_microbatches_defaults_to_two_per_stage(tmp_path, capsys, monkeypatch):
    import yaml

    code, out, err = run_cli(["train", "--strategy", "pipeline", "--stages", "2", "--gpus", "2", "--device", "cpu", "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "# pipeline: --microbatches not given: 4 micro-batches per step (2 per stage for 2 stages" in out
    resolved = yaml.safe_load(out.split("# DeepSpeed config")[0])  # the note is a comment: the output stays YAML
    assert (resolved["micro_batch"], resolved["grad_accum"], resolved["global_batch"]) == (8, 4, 32)
    # a global batch per pipeline that 2S does not divide takes S micro-batches
    code, out, err = run_cli(["train", "--strategy", "pipeline", "--gpus", "2", "--global-batch", "6", "--device", "cpu", "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert (resolved["micro_batch"], resolved["grad_accum"], resolved["global_batch"]) == (3, 2, 6)


def test_a_dry_run_under_torchrun_resolves_torchruns_world(tmp_path, capsys, monkeypatch):
    """torchrun (or srun) started this process: the dry run shows the batch `train` would run with in that world of 4
    (two pipelines of 2 stages), not the one --gpus alone gives (1 process: no pipeline of 2 stages)."""
    import yaml

    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "4"), monkeypatch.setenv("LOCAL_RANK", "0")
    code, out, err = run_cli(["train", "--strategy", "pipeline", "--stages", "2", "--device", "cpu", "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0, err
    resolved = yaml.safe_load(out.split("# DeepSpeed config")[0])
    assert (resolved["micro_batch"], resolved["grad_accum"], resolved["global_batch"]) == (8, 4, 64)


def test_pipeline_microbatch_mistakes_are_one_line(tmp_path, capsys, monkeypatch):
    base = ["train", "--strategy", "pipeline", "--stages", "2", "--gpus", "2", "--device", "cpu", "--max-steps", "1"]
    assert_error(base + ["--microbatches", "1"], tmp_path, capsys, monkeypatch, "1f1b needs at least one micro-batch per stage",
                 "--microbatches 4", "--schedule gpipe")
    # the batch triple derives M = 1 (global 2 = micro 2 x M x 1 pipeline)
    assert_error(base + ["--micro-batch", "2", "--global-batch", "2"], tmp_path, capsys, monkeypatch, "1f1b", "1 micro-batch(es) for 2 stages")
    assert_error(base + ["--global-batch", "5"], tmp_path, capsys, monkeypatch, "global_batch 5", "2 stages", "multiple of 2")


def test_plan_pipeline_row_uses_the_default_microbatches():
    from shardlab.config import RunConfig
    from shardlab.planning.planner import plan

    for strategy in ("dp", "pipeline"):  # the pipeline row of any plan is planned as `train --strategy pipeline` runs
        result = plan(RunConfig(model="tiny-gpt2", strategy=strategy, gpus=2, seq_len=64, micro_batch=2), gpu_memory_gb=16,
                      strategies=("pipeline",), max_search=4)
        assert "1f1b, 2 GPU(s) per pipeline x 1 replica(s), 4 micro-batches" in result.strategies["pipeline"].notes[0]


@pytest.mark.slow
def test_pipeline_without_microbatches_trains(tmp_path, train_cli):
    run = train_cli(["--strategy", "pipeline", "--stages", "2", "--gpus", "2", "--micro-batch", "1", "--max-steps", "2",
                     "--seq-len", "16", "--no-export"], tmp_path / "run").check()
    assert "--microbatches not given: 4 micro-batches per step" in run.stdout
    # both steps ran, each over 4 micro-batches (a run that stopped after one step, or logged none, passed `>= 1` rows)
    assert run.config["grad_accum"] == 4 and run.summary["steps"] == 2 and run.summary["grad_accum"] == 4
    assert [r["step"] for r in run.rows] == [2] and math.isfinite(run.losses[0])


# ---- 11. pipeline simulate --schedule pipedream -------------------------------------------------------


def test_pipedream_simulates_several_steps_by_default(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["pipeline", "simulate", "--schedule", "pipedream"], tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "pipedream: 4 stages x 8 micro-batches, 3 step(s)" in out and "one step alone looks like 1f1b" in out
    assert "F8 " in out  # the second step's micro-batches appear, inside the first one's drain (no flush)
    code, one_step, err = run_cli(["pipeline", "simulate", "--schedule", "pipedream", "--steps", "1"], tmp_path, capsys, monkeypatch)
    assert code == 0, err
    _, f1b1, _ = run_cli(["pipeline", "simulate", "--schedule", "1f1b"], tmp_path, capsys, monkeypatch)
    timeline = lambda text: [line for line in text.splitlines() if line.startswith("dev")]  # noqa: E731
    assert timeline(one_step) == timeline(f1b1)  # what the note explains
    assert "its timeline equals 1f1b's" in one_step and "use --steps 3" in one_step
    assert "note:" not in f1b1


# ---- 2, 3. QA data: answer-only loss, misplaced SQuAD answers ------------------------------------------


def squad_file(path: Path, n: int, misplaced: set[int]) -> Path:
    """SQuAD v1.1's JSON layout; the questions in `misplaced` get an answer_start past the end of the context."""
    import json

    context = "The items are " + ", ".join(f"thing{i}" for i in range(n)) + ", in that order."
    qas = [{"id": str(i), "question": f"Which is item {i}?",
            "answers": [{"text": f"thing{i}", "answer_start": len(context) + 5 if i in misplaced else context.index(f"thing{i}")}]}
           for i in range(n)]  # fmt: skip
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "T", "paragraphs": [{"context": context, "qas": qas}]}]}))
    return path


def shardlab_subprocess(argv: list[str], cwd: Path):
    """`python -m shardlab ARGV` in a fresh process (forked from the session's zygote: zygote.py)."""
    return run_shardlab(argv, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=cwd, timeout=300)


def test_squad_with_no_answer_at_answer_start_is_one_line(tmp_path):
    data = squad_file(tmp_path / "train-v1.1.json", 3, misplaced={0, 1, 2})
    proc = shardlab_subprocess(["train", "--dataset", str(data), "--format", "qa", "--max-steps", "1", "--seq-len", "32",
                                "--output-dir", str(tmp_path / "run")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_error_line(proc.stderr, "no usable training examples", "3 QA example(s) have no answer at their answer_start", "fix answer_start")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_answer_only_loss_on_and_off_train_differently(tmp_path, train_cli):
    data = squad_file(tmp_path / "train-v1.1.json", 24, misplaced={5, 9})
    base = ["--dataset", str(data), "--format", "qa", "--packing", "pad", "--eval-split", "0", "--seq-len", "128",
            "--micro-batch", "4", "--max-steps", "3", "--lr", "1e-3", "--no-export", "--log-every", "1"]
    on = train_cli(base + ["--answer-only-loss"], tmp_path / "on").check()
    off = train_cli(base + ["--no-answer-only-loss"], tmp_path / "off").check()
    for run in (on, off):  # the two misplaced answers are skipped and said so, in one line
        assert run.stdout.count("skipped 2 QA example(s) whose answer is not at its answer_start") == 1, run.stdout
    # the same examples, the same first batch: the losses differ only because the labels do
    assert on.losses[0] != pytest.approx(off.losses[0], rel=1e-3)


# ---- 10. shardlab slurm: CPUs per task and shared paths ------------------------------------------------


def test_slurm_sets_cpus_per_task_from_the_workers_and_names_shared_paths(tmp_path, capsys, monkeypatch):
    data = tmp_path / "corpus.txt"
    data.write_text("some text\n")
    out = tmp_path / "run"
    code, stdout, err = run_cli(["slurm", "--gpus", "4", "--nodes", "2", "--dataset", str(data), "--output-dir", str(out)],
                                tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "--cpus-per-task not given: 4 (one CPU core per worker" in stdout
    script = next(out.glob("slurm/*/job.sbatch")).read_text()
    assert "#SBATCH --cpus-per-task=4" in script
    shared = [line for line in script.splitlines() if line.startswith("#   ")]
    assert any(str(out) in line and "checkpoints" in line for line in shared)
    assert any(str(data) in line and "dataset" in line for line in shared)
    assert any("SHARDLAB_CACHE" in line for line in shared) and any("HF_HOME" in line for line in shared)
    assert "every node needs on a shared filesystem" in stdout
    # given: used as it is, nothing said
    code, stdout, err = run_cli(["slurm", "--gpus", "2", "--cpus-per-task", "16", "--output-dir", str(tmp_path / "run2")],
                                tmp_path, capsys, monkeypatch)
    assert code == 0 and "--cpus-per-task not given" not in stdout
    assert "#SBATCH --cpus-per-task=16" in next((tmp_path / "run2").glob("slurm/*/job.sbatch")).read_text()


# ---- 4, 5. --deepspeed-config: checked before the spawn; peers' files train unchanged ---------------------

PEER_JSONS = Path(__file__).parent / "data"
ACCELERATE_JSON = PEER_JSONS / "accelerate_zero_stage3_offload_config.json"
AXOLOTL_JSON = PEER_JSONS / "axolotl_zero3_bf16_cpuoffload_all.json"


def test_deepspeed_json_mistakes_are_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    import json

    bad_batch = tmp_path / "ds_batch.json"
    bad_batch.write_text(json.dumps({"train_batch_size": 7, "zero_optimization": {"stage": 2}}))
    run = ["train", "--max-steps", "1", "--device", "cpu", "--output-dir", "run"]
    # a batch flag that contradicts the JSON's batch size
    assert_error(run + ["--strategy", "zero2", "--micro-batch", "2", "--deepspeed-config", str(bad_batch)], tmp_path, capsys,
                 monkeypatch, "train_batch_size=7", "resolves it to 2", '"auto"')
    # no batch flag: the JSON's size is taken, and on two ranks 7 does not split: still one line from the launching
    # process, before any worker exists, naming the JSON
    assert_error(run + ["--gpus", "2", "--deepspeed-config", str(bad_batch)], tmp_path, capsys, monkeypatch,
                 "ds_batch.json sets train_batch_size 7", "not divisible by the data-parallel world size 2", '"auto"')
    # the JSON's ZeRO stage and offload against --strategy: name the strategy that matches
    assert_error(run + ["--strategy", "zero2", "--deepspeed-config", str(ACCELERATE_JSON)], tmp_path, capsys, monkeypatch,
                 "stage 3, offload to cpu", "strategy zero3_offload", "--strategy is zero2", "--strategy zero3_offload")
    assert_error(run + ["--strategy", "zero3", "--deepspeed-config", str(AXOLOTL_JSON)], tmp_path, capsys, monkeypatch,
                 "--strategy zero3_offload")
    nvme_stage2 = tmp_path / "ds_nvme.json"
    nvme_stage2.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}))
    assert_error(run + ["--deepspeed-config", str(nvme_stage2)], tmp_path, capsys, monkeypatch, "stage 2, offload to nvme",
                 "no shardlab strategy")


def test_peer_json_fills_every_auto_and_decides_what_the_run_left_open(tmp_path, capsys, monkeypatch):
    import json

    code, out, err = run_cli(["train", "--deepspeed-config", str(ACCELERATE_JSON), "--device", "cpu", "--lr", "3e-4", "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "# strategy zero3_offload, from accelerate_zero_stage3_offload_config.json (zero_optimization.stage 3, offload to cpu)" in out
    assert "enables fp16, which CPU training does not support: precision fp32" in out
    assert "warmup_num_steps 'auto' with no warm-up: 1" in out
    ds = json.loads(out.split("# DeepSpeed config\n")[1])
    assert "auto" not in json.dumps(ds)
    assert ds["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1,
                                         "total_num_steps": "<the run's optimizer steps>"}  # filled when the data is built
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["fp16"]["enabled"] is False
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 8, 1)
    code, out, err = run_cli(["train", "--deepspeed-config", str(AXOLOTL_JSON), "--device", "cpu", "--warmup-steps", "3", "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "# precision bf16, from axolotl_zero3_bf16_cpuoffload_all.json" in out and "warmup_num_steps" not in out.split("model:")[0]
    ds = json.loads(out.split("# DeepSpeed config\n")[1])
    assert ds["bf16"]["enabled"] is True and ds["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("peer_json", [ACCELERATE_JSON, AXOLOTL_JSON], ids=["accelerate", "axolotl"])
def test_peer_deepspeed_json_trains_unchanged(peer_json, tmp_path, train_cli):
    run = train_cli(["--deepspeed-config", str(peer_json), "--max-steps", "10", "--seq-len", "32", "--micro-batch", "2",
                     "--lr", "2e-3", "--log-every", "1", "--no-export",
                     "--set", "dataset.eval_samples=1"], tmp_path / "run").check()  # 227 eval blocks: 16 s each eval in bf16
    assert run.config["strategy"] == "zero3_offload" and f"strategy zero3_offload, from {peer_json.name}" in run.stdout
    losses = run.losses
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses


# ---- 6. an output dir that holds another run ---------------------------------------------------------


def finished_run(out: Path, with_checkpoint: bool = False) -> list[str]:
    """The files a finished run leaves (their contents do not matter to the check); returns their names."""
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    for name in ("summary.json", "metrics.jsonl", "config.yaml", "env.json", "cpu_memory.csv"):
        (out / name).write_text("{}\n")
    if with_checkpoint:
        from shardlab.checkpoint.store import TRAINER_STATE

        (out / "checkpoints" / "step-0000002").mkdir(parents=True)
        (out / "checkpoints" / "step-0000002" / TRAINER_STATE).write_text("{}")
    return sorted(p.name for p in out.rglob("*"))


def test_reusing_a_finished_runs_dir_is_refused(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cwd" / "run"
    before = finished_run(out)
    run = ["train", "--max-steps", "1", "--seq-len", "16", "--output-dir", str(out)]
    for extra in ([], ["--no-export"], ["--resume", "auto"]):
        line = assert_error(run + extra, tmp_path, capsys, monkeypatch, "already holds a finished run", "--overwrite", "--resume auto")
        assert ("no checkpoint to resume from" in line) == (extra == ["--resume", "auto"])
        assert sorted(p.name for p in out.rglob("*")) == before  # nothing deleted, nothing added
    code, stdout, err = run_cli(run + ["--dry-run"], tmp_path, capsys, monkeypatch)  # writes nothing, so only says it
    assert code == 0 and "# note: `train` would refuse this: output dir" in stdout, err
    # a crashed run's leftovers (no summary) are another run too
    (out / "summary.json").unlink()
    assert_error(run, tmp_path, capsys, monkeypatch, "another run's files", "config.yaml")


def test_stale_run_files_decides_what_a_new_run_may_delete(tmp_path, monkeypatch):
    from shardlab.config import RunConfig
    from shardlab.launch.launcher import stale_run_files

    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "run"
    (out / "slurm" / "20260101-000000").mkdir(parents=True)  # `shardlab slurm`'s snapshot: not a run
    assert stale_run_files(RunConfig(output_dir=str(out), resume="auto")) == []
    finished_run(out, with_checkpoint=True)
    assert stale_run_files(RunConfig(output_dir=str(out), resume="auto")) == []  # a resume that resumes
    names = lambda paths: sorted(p.name for p in paths)  # noqa: E731
    everything = ["checkpoints", "config.yaml", "cpu_memory.csv", "env.json", "metrics.jsonl", "model", "summary.json"]
    assert names(stale_run_files(RunConfig(output_dir=str(out), overwrite=True))) == everything  # slurm/ stays
    # a requeued job whose first attempt died before any checkpoint: its leftovers go, it starts fresh
    for name in ("checkpoints", "model"):
        import shutil

        shutil.rmtree(out / name)
    (out / "summary.json").unlink()
    assert names(stale_run_files(RunConfig(output_dir=str(out), resume="auto"))) == ["config.yaml", "cpu_memory.csv", "env.json", "metrics.jsonl"]


@pytest.mark.slow
def test_overwrite_replaces_the_old_run_and_leaves_none_of_its_files(tmp_path, train_cli):
    out = tmp_path / "run"
    base = ["--max-steps", "2", "--seq-len", "16", "--micro-batch", "2", "--set", "dataset.eval_samples=2"]
    train_cli(base, out).check()
    assert (out / "model").is_dir()
    refused = train_cli(base + ["--no-export"], out)
    assert refused.returncode == 2 and "already holds a finished run" in refused.stderr
    run = train_cli(base + ["--no-export", "--overwrite", "--seed", "7"], out).check()
    assert "--overwrite: deleting the earlier run's files" in run.stdout
    assert not (out / "model").exists() and run.config["seed"] == 7
    # metrics.jsonl is the new run's alone: one row for its 2 steps (log every 10, and the last step), where rows left
    # by the old run would come first (this asserted `>= 1` rows, which an appended file passed)
    assert [r["step"] for r in run.rows] == [2] and run.summary["steps"] == 2


def test_pipeline_options_given_to_another_strategy_are_named_as_unused(capsys):
    """--stages/--schedule/--chunks mean nothing to dp: one line says so (not an error: a bench's shared --set or a
    YAML written for several strategies carries them to every cell); a pipeline run and defaults say nothing."""
    from shardlab.config import RunConfig
    from shardlab.launch.launcher import preflight

    opts = {"pp_stages": 2, "pp_chunks": 3}
    capsys.readouterr()
    preflight(RunConfig(model="tiny-gpt2", device="cpu", strategy="dp", strategy_options=opts))
    assert "--stages, --chunks: pipeline options, unused by strategy 'dp'" in capsys.readouterr().out
    preflight(RunConfig(model="tiny-gpt2", device="cpu", strategy="zero2"))
    assert "pipeline options" not in capsys.readouterr().out


# ---- a third sweep (2026-11-27): the output directory, the seed, the attention backend, a strategy's spelling ------


def test_an_output_dir_that_cannot_be_a_run_directory_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    """A file where the directory should be, a file among its parents, or a parent nobody can write in: each ended the
    first rank in a traceback (FileExistsError, NotADirectoryError, FileNotFoundError under /proc) after the data was
    staged."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    base = ["train", "--dataset", "synthetic", "--max-steps", "1", "--output-dir"]
    assert_error(base + [str(afile)], tmp_path, capsys, monkeypatch, "is a file, not a directory")
    assert_error(base + [str(afile / "sub")], tmp_path, capsys, monkeypatch, "cannot create --output-dir", "is a file")
    assert_error(base + ["/proc/shardlab-test/run"], tmp_path, capsys, monkeypatch, "cannot create --output-dir", "/proc")
    assert afile.read_text() == "not a directory"
    assert not any(p.name.startswith(".shardlab-probe-") for p in tmp_path.iterdir())  # the write probe is gone


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_outside_numpys_range_is_a_config_error(seed, tmp_path, capsys, monkeypatch):
    # numpy's legacy seeding (the data pipeline's) raised "Seed must be between 0 and 2**32 - 1" inside the rank
    assert_error(["train", "--dataset", "synthetic", "--seed", seed], tmp_path, capsys, monkeypatch, "'seed'")


def test_flash_attention_without_flash_attn_is_refused_before_the_data_is_staged(tmp_path, capsys, monkeypatch):
    import shardlab.training.models as models

    monkeypatch.setattr(models, "_flash_attn_importable", lambda: False)  # whatever this machine has installed
    assert_error(["train", "--device", "cpu", "--attn-implementation", "flash_attention_2", "--output-dir", "run"],
                 tmp_path, capsys, monkeypatch, "flash_attn")


@pytest.mark.parametrize("given,meant", [("DP", "dp"), ("zero-3", "zero3"), ("FSDP_Offload", "fsdp_offload")])
def test_a_misspelt_strategy_is_named_with_the_one_meant(given, meant, tmp_path, capsys, monkeypatch):
    assert_error(["train", "--strategy", given], tmp_path, capsys, monkeypatch, f"did you mean '{meant}'")


@pytest.mark.parametrize("argv,words", [
    (["--strategy", "pipeline", "--gpus", "2", "--peft", "lora"], ("--peft lora", "'pipeline'", "module names", "--strategy dp")),
    (["--strategy", "fsdp", "--peft", "qlora"], ("--peft qlora", "'fsdp'", "4-bit", "--strategy dp")),
    (["--peft", "lora", "--micro-batch", "auto"], ("--micro-batch auto", "does not model adapters", "--micro-batch N")),
], ids=["pipeline", "qlora-fsdp", "auto-batch"])
def test_what_adapters_cannot_run_with_is_one_line_before_any_worker(argv, words, tmp_path, capsys, monkeypatch):
    assert_error(["train", "--device", "cpu", "--dataset", "synthetic", "--output-dir", "run", *argv], tmp_path, capsys,
                 monkeypatch, *words)


def test_the_cpu_plan_says_it_does_not_model_adapters_rather_than_a_wrong_figure(tmp_path, capsys, monkeypatch):
    # the GPU plan models them (planning/adapters.py); the CPU plan (planning/cpu_plan.py) does not yet
    assert_error(["plan", "--peft", "lora", "--gpu-memory-gb", "80", "--device", "cpu"], tmp_path, capsys, monkeypatch,
                 "the CPU plan does not model adapters yet", "drop --peft")


_NODES_ALONE = """
import sys
import shardlab.launch.launcher as launcher
launcher.RENDEZVOUS_TIMEOUT_S = 3
from shardlab.cli import main
sys.exit(main(["train", "--nodes", "2", "--node-rank", sys.argv[1], "--master-port", sys.argv[2], "--device", "cpu",
               "--dataset", "synthetic", "--max-steps", "1", "--output-dir", sys.argv[3]]))
"""


@pytest.mark.slow  # two launcher processes, each waiting out its rendezvous timeout
@pytest.mark.parametrize("node_rank", ["0", "1"])
def test_a_node_whose_peers_never_start_says_so_in_one_line(node_rank, tmp_path):
    """`--nodes 2` with no second node (a hostfile forgotten, or --nodes taken for GPUs): the launcher says it waits and
    for how long, then gives up with one line naming the fix, not a DistStoreError/DistNetworkError traceback."""
    import subprocess
    import sys

    from shardlab.runtime.distributed import free_port

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _NODES_ALONE, node_rank, str(free_port()), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "waiting up to 3 s for all 2 nodes to join" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"node {node_rank} of 2 gave up waiting for the other nodes" in errors[0]
    assert "--node-rank" in errors[0] and "shardlab slurm" in errors[0]
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.slow  # a supervised launcher, stopped while it waits
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_ends_a_node_that_waits_for_the_others(sig, tmp_path):
    """The wait for the other nodes is a C++ call that holds the launcher's Python for up to 600 s: Ctrl-C (SIGINT to
    the terminal's process group) or SIGTERM did nothing until it ended. The supervising `shardlab train` process now
    ends it at once while no worker has started, in one line."""
    import signal
    import subprocess
    import sys
    import time

    from shardlab.runtime.distributed import free_port

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDLAB_SUPERVISED")}
    proc = subprocess.Popen([sys.executable, "-m", "shardlab", "train", "--nodes", "2", "--device", "cpu", "--dataset",
                             "synthetic", "--max-steps", "1", "--master-port", str(free_port()), "--output-dir", str(out)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = ""
        while "waiting up to" not in line:  # the launcher has started to wait
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]
        time.sleep(1)
        if sig == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        else:
            proc.send_signal(signal.SIGTERM)  # `kill PID` of the command the user started
        _, err = proc.communicate(timeout=60)  # a guard: still waiting for the rendezvous (600 s) raises here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + getattr(signal, sig)
    errors = [e for e in err.splitlines() if e.startswith("error: ")]
    assert errors == [f"error: stopped by {sig} while waiting for the other nodes to join (no worker had started)"]
    assert not out.exists()
