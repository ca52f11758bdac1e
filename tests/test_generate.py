"""`shardlab generate`, samples.md, the eval tracker (initial / best / early stopping) and --save-best.

The in-process tests use a tiny-gpt2 saved the way a run exports it (RUN_DIR/model); the one training
run (slow) forces early stopping with a learning rate so large that every eval after the first step is
worse than the one before it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardlab.cli import main
from shardlab.training.early_stopping import EvalTracker
from shardlab.errors import UserError
from shardlab.loop.generate import SAMPLE_PROMPTS, complete, load, model_dir, samples_markdown


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory whose model/ is a random-init tiny-gpt2 with its tokenizer, as checkpoint.export_hf writes."""
    from shardlab.config import RunConfig
    from shardlab.training.models import build_model
    from shardlab.training.tokenizing import load_tokenizer

    cfg = RunConfig(model="tiny-gpt2")
    run = tmp_path_factory.mktemp("run")
    build_model(cfg).save_pretrained(run / "model")
    load_tokenizer(cfg).save_pretrained(run / "model")
    (run / "summary.json").write_text("{}")
    return run


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- generate ----------------------------------------------------------------------------------------


def test_greedy_is_the_argmax_chain_of_the_exported_model(run_dir, capsys):
    code, out, _ = generate(capsys, str(run_dir), "--prompt", "The with statement", "--max-new-tokens", "6")
    assert code == 0
    model, tok, source = load(str(run_dir))
    assert source == str(run_dir / "model")  # a run directory stands for its export
    ids = tok("The with statement", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(6):  # greedy by hand: append the most likely next token
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out == tok.decode(ids[0], skip_special_tokens=True) + "\n"


def test_sampling_repeats_with_a_seed_and_differs_from_greedy(run_dir, capsys):
    args = [str(run_dir / "model"), "--prompt", "A generator", "--max-new-tokens", "12", "--sample", "--temperature", "1.5", "--seed", "3"]
    first, second = generate(capsys, *args), generate(capsys, *args)
    assert first[0] == 0 and first[1] == second[1]  # a plain model directory works too
    greedy = generate(capsys, str(run_dir), "--prompt", "A generator", "--max-new-tokens", "12")[1]
    # 12 tokens drawn at temperature 1.5 from a random model's near-uniform 50257-way distribution: never its argmax chain
    assert first[1] != greedy and first[1].startswith("A generator")


@pytest.mark.parametrize("args,message", [
    (["{missing}", "--prompt", "x"], "is neither a directory nor a model available offline"),
    (["{empty}", "--prompt", "x"], "holds neither a model (config.json) nor a run's exported model/"),
    (["{no_export}", "--prompt", "x"], "has no exported model (model/)"),
    (["{run}", "--prompt", "x", "--temperature", "0.7"], "--temperature applies to sampling"),
    (["{run}", "--prompt", "x", "--sample", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["{run}", "--prompt", "x", "--max-new-tokens", "5000"], "exceed the model's 1024 positions"),
])  # fmt: skip
def test_mistakes_are_one_line_errors(run_dir, tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_export").mkdir()
    (tmp_path / "no_export" / "summary.json").write_text("{}")
    paths = {"missing": str(tmp_path / "runs" / "nope"), "empty": str(tmp_path / "empty"), "no_export": str(tmp_path / "no_export"), "run": str(run_dir)}
    code, out, err = generate(capsys, *[a.format(**paths) for a in args])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_model_dir_resolution(run_dir, tmp_path):
    assert model_dir(str(run_dir)) == str(run_dir / "model")
    assert model_dir(str(run_dir / "model")) == str(run_dir / "model")
    assert model_dir("tiny-gpt2") == "tiny-gpt2"  # not a path: shardlab.training.models resolves it
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text("model: tiny-gpt2\n")
    # a --no-export run without checkpoints: nothing to export either, so no `shardlab export` to suggest
    with pytest.raises(UserError, match="no checkpoint: .* its trained weights were not kept") as refused:
        model_dir(str(tmp_path / "r"))
    assert "shardlab export" not in str(refused.value)
    step = tmp_path / "r" / "checkpoints" / "step-0000002"  # with one, export is the way
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    with pytest.raises(UserError, match="shardlab export"):
        model_dir(str(tmp_path / "r"))


def test_samples_markdown_fences_and_missing_after():
    text = samples_markdown("m", ["a ```b"], [" c"], None, "no exported model: the run had --no-export")
    assert "````text\na ```b c\n````" in text  # a fence longer than the text's own backticks
    assert "After fine-tuning: none (no exported model: the run had --no-export)." in text
    # a model built as shards only (FSDP2 from meta, ZeRO-3 partitions) has no completions before training: said why
    text = samples_markdown("m", ["p"], "only shards were built", [" x"], "the exported model, step 3")
    assert "Before fine-tuning: none (only shards were built)." in text and "```text\np x\n```" in text


def test_complete_keeps_the_random_state_and_the_training_mode(run_dir):
    from shardlab.loop.generate import complete_all

    model, tok, _ = load(str(run_dir))
    model.train()
    before = torch.get_rng_state()
    texts = complete_all(model, tok, SAMPLE_PROMPTS[:1])
    assert torch.equal(before, torch.get_rng_state()) and model.training
    assert texts == [complete(model, tok, SAMPLE_PROMPTS[0])]


# ---- the tracker ---------------------------------------------------------------------------------------


def test_tracker_best_patience_and_resume():
    t = EvalTracker(patience=2, initial=5.0)
    assert t.update(1, 4.0) and not t.update(2, 4.0)  # equal is no improvement
    assert t.update(3, 3.5) and (t.best, t.best_step, t.since_best) == (3.5, 3, 0)
    assert not t.update(4, math.nan) and not t.stopped_early  # NaN never improves; one bad eval of two allowed
    resumed = EvalTracker.restore(2, json.loads(json.dumps(t.state())))  # through trainer_state.json
    assert resumed == t
    assert not resumed.update(5, 3.6) and resumed.stopped_early
    assert resumed.summary() == {"initial_eval_loss": 5.0, "best_eval_loss": 3.5, "best_step": 3, "stopped_early": True,
                                 "early_stopping_patience": 2}
    never = EvalTracker()
    for step in range(1, 20):
        never.update(step, float(step))
    assert never.best_step == 1 and not never.stopped_early  # no patience: never stops


def test_early_stopping_needs_one_eval_split():
    from shardlab.config import config_from_dict

    with pytest.raises(UserError, match="a curriculum's stages each have their own"):
        config_from_dict({"save_best": True, "curriculum": [{"dataset": {"source": "offline"}, "max_steps": 1}]})


def test_report_shows_the_eval_losses_and_early_stopping(tmp_path):
    from shardlab.report.load import load as load_runs
    from shardlab.report.render import to_markdown
    from shardlab.report import build_tables

    for name, extra in (("stopped", {"stopped_early": True, "early_stopping_patience": 2, "exported_step": 3}), ("plain", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(f"model: tiny-gpt2\nseed: {len(name)}\n")
        summary = {"model": "tiny-gpt2", "strategy": "dp", "steps": 5, "initial_eval_loss": 3.21875, "final_eval_loss": 2.96875,
                   "best_eval_loss": 2.90625, "best_step": 3, **extra}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    table = next(t for t in build_tables(load_runs([tmp_path / "stopped", tmp_path / "plain"])) if t.key == "eval")
    text = to_markdown(table)
    assert "| stopped | 5 | 3.219 | 2.969 | 2.906 | 3 | 3 | yes (patience 2) |" in text
    assert "| plain | 5 | 3.219 | 2.969 | 2.906 | 3 |  | no early stopping |" in text


# ---- a run: initial eval, early stopping, the best step exported, samples.md -------------------------------------


@pytest.mark.slow  # a training subprocess of ~20 s (sharded: several processes)
@pytest.mark.parametrize("strategy,gpus", [("dp", 1), ("fsdp", 2), ("pipeline", 2)])
def test_early_stopping_exports_the_best_step(tmp_path, train_cli, trainer_eval_loss, strategy, gpus):
    from transformers import AutoModelForCausalLM

    from shardlab.config import load_config
    from shardlab.data import build_datasets
    from shardlab.training.tokenizing import load_tokenizer

    # lr 0.5, constant: Adam's first step moves every weight by ~0.5 and each later step makes the eval loss worse
    run = train_cli(["--model", "tiny-gpt2", "--num-samples", "8", "--set", "dataset.eval_samples=2", "--seq-len", "32",
                     "--micro-batch", "2", "--grad-accum", "1", "--max-steps", "12", "--lr", "0.5", "--lr-schedule", "constant",
                     "--precision", "fp32", "--eval-every", "1", "--early-stopping-patience", "2", "--save-best", "--samples",
                     "--strategy", strategy, "--gpus", str(gpus)] + (["--grad-accum", "2", "--micro-batch", "1"] if strategy == "pipeline" else []),
                    tmp_path / "run").check()  # fmt: skip
    s = run.summary
    evals = {r["step"]: r["eval_loss"] for r in run.all_rows if "eval_loss" in r}
    assert s["initial_eval_loss"] == evals[0]
    trained = {k: v for k, v in evals.items() if k > 0}
    assert s["best_step"] == min(trained, key=trained.get) and s["best_eval_loss"] == trained[s["best_step"]]
    assert s["stopped_early"] and s["steps"] == s["best_step"] + 2 < 12  # patience 2: two evaluations after the best
    assert s["exported_step"] == s["best_step"] and s["final_eval_loss"] == evals[s["steps"]] > s["best_eval_loss"]
    assert (run.out / "checkpoints" / "best" / "trainer_state.json").is_file()
    assert json.loads((run.out / "checkpoints" / "best" / "trainer_state.json").read_text())["global_step"] == s["best_step"]
    # the exported model is the best step's: it reproduces the best eval loss, not the last one
    cfg = load_config(run.out / "config.yaml")
    splits = build_datasets(cfg.dataset, load_tokenizer(cfg), cfg.seq_len, cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(run.out / "model").eval()
    blocks, world = splits.eval, s["world_size"]
    if strategy == "pipeline":  # one data-parallel replica; whole eval batches of micro x accum = 2 blocks only
        blocks, world = torch.utils.data.Subset(blocks, range(len(blocks) // 2 * 2)), 1
    assert trainer_eval_loss(model, blocks, world) == pytest.approx(s["best_eval_loss"], rel=1e-4)
    samples = (run.out / "samples.md").read_text()
    assert samples.count("Before fine-tuning:") == samples.count("After fine-tuning:") == len(SAMPLE_PROMPTS)
    assert f"the exported model, step {s['best_step']}" in samples
    tok = load_tokenizer(cfg)
    after = complete(model, tok, SAMPLE_PROMPTS[0])
    assert f"{SAMPLE_PROMPTS[0]}{after}\n" in samples  # the after-text is the exported model's greedy completion
