"""The loss weighs tokens, as transformers' Trainer does: a step's summed token losses over its label tokens, across
micro-batches and ranks, on answer-only QA data whose micro-batches hold different numbers of label tokens.

- shardlab (dp, one rank, accumulation 4) against `transformers.Trainer` fed the same blocks in the same order, from
  the same weights, with the same warm-up and decay: equal losses and gradient norms at every step.
- 2 ranks with accumulation 4 against 1 rank with accumulation 8 (the same samples in each step): the step's token
  count is all-reduced before the first backward.
- Every engine against dp: DeepSpeed (whose engine.backward would divide by the accumulation again), FSDP2 and the
  pipeline (whose schedule would divide by its micro-batch count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # several trainings, some on 2 ranks (conftest.py: the tiers)

SEED = 11
EXAMPLES = 48  # 6 steps of 8 (micro 2 x accum 4), one epoch
STEPS = 6
WORDS = "red green blue yellow orange purple violet silver golden amber crimson".split()


def qa_file(path: Path) -> Path:
    """SQuAD v1.1's layout, one question per context; answers of 1 to 8 words, so that with answer-only loss the
    micro-batches carry from a few to dozens of label tokens."""
    data = []
    for i in range(EXAMPLES):
        answer = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (i * 5) % 8))
        context = f"Record {i} lists the colours {answer} and nothing else."
        qa = {"id": str(i), "question": f"Which colours does record {i} list?",
              "answers": [{"text": answer, "answer_start": context.index(answer)}]}
        data.append({"title": f"t{i}", "paragraphs": [{"context": context, "qas": [qa]}]})
    path.write_text(json.dumps({"version": "1.1", "data": data}))
    return path


@pytest.fixture(scope="session")
def qa_data(tmp_path_factory) -> Path:
    return qa_file(tmp_path_factory.mktemp("token-loss") / "train-v1.1.json")


def args(data: Path, *, strategy: str = "dp", gpus: int = 1, accum: int = 4) -> list[str]:
    return ["--model", "tiny-gpt2", "--strategy", strategy, "--dataset", str(data), "--format", "qa", "--answer-only-loss",
            "--packing", "pad", "--seq-len", "48", "--eval-split", "0", "--micro-batch", "2", "--grad-accum", str(accum),
            "--max-steps", str(STEPS), "--lr", "1e-3", "--warmup-steps", "2", "--lr-schedule", "linear", "--dropout", "0",
            "--precision", "fp32", "--log-every", "1", "--seed", str(SEED), "--no-export", "--device", "cpu",
            *(["--gpus", str(gpus)] if gpus > 1 else [])]  # fmt: skip


def rows(run) -> list[dict]:
    run.check()
    assert [r["step"] for r in run.rows] == list(range(1, STEPS + 1))
    return run.rows


def assert_same_steps(got: list[dict], want: list[dict], what: str) -> None:
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), f"{what}, step {a['step']}: loss {a['loss']} vs {b['loss']}"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), f"{what}, step {a['step']}: grad norm {a['grad_norm']} vs {b['grad_norm']}"
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6, abs=1e-12), f"{what}, step {a['step']}: lr {a['lr']} vs {b['lr']}"


class Recorded:
    """A `transformers.Trainer` that keeps, per optimizer step, the sum of its micro-batches' returned losses (each the
    micro-batch's summed token losses over the step's label tokens: their sum is the step's token-weighted mean)."""

    @staticmethod
    def trainer_class():
        import transformers

        class RecordingTrainer(transformers.Trainer):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.micro_losses: list[float] = []

            def training_step(self, model, inputs, num_items_in_batch=None):
                loss = super().training_step(model, inputs, num_items_in_batch)
                self.micro_losses.append(float(loss))
                return loss

        return RecordingTrainer


def trainer_twin(data: Path, out: Path) -> list[dict]:
    """The run of `args(data)` as transformers.Trainer trains it: shardlab's own blocks in the order shardlab's sampler
    gives them, shardlab's initial weights (the same seeded build), the same optimizer, clipping and schedule."""
    import transformers

    from shardlab.config import load_config
    from shardlab.data import build_datasets
    from shardlab.training.models import apply_dropout, build_model
    from shardlab.training.tokenizing import run_tokenizer
    from shardlab.training.sampling import SeekableDistributedSampler
    from shardlab.loop.trainer import seed_everything

    cfg = load_config(None, {"model": "tiny-gpt2", "device": "cpu", "seq_len": 48, "seed": SEED, "dropout": 0.0,
                             "dataset": {"source": str(data), "format": "qa", "answer_only_loss": True, "packing": "pad",
                                         "eval_split": 0.0}})  # fmt: skip
    blocks = build_datasets(cfg.dataset, run_tokenizer(cfg), cfg.seq_len, cfg.seed).train
    sampler = SeekableDistributedSampler(blocks, num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=True)
    sampler.set_epoch(0)
    ordered = torch.utils.data.Subset(blocks, list(sampler))
    seed_everything(SEED)  # as the trainer does just before it builds the model
    model = build_model(cfg, dtype=torch.float32)
    apply_dropout(model, 0.0)
    targs = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=STEPS,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=SEED, train_sampling_strategy="sequential", dataloader_drop_last=True,
        remove_unused_columns=False, disable_tqdm=True)  # fmt: skip
    trainer = Recorded.trainer_class()(model=model, args=targs, train_dataset=ordered)
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    steps = [sum(trainer.micro_losses[4 * i: 4 * i + 4]) for i in range(STEPS)]
    assert len(logged) == STEPS
    for r, loss in zip(logged, steps):
        assert r["loss"] == pytest.approx(loss, rel=1e-6)  # what Trainer logs is that sum
    return [{"step": r["step"], "loss": loss, "grad_norm": r["grad_norm"], "lr": r["learning_rate"]} for r, loss in zip(logged, steps)]


def test_losses_and_gradient_norms_equal_transformers_trainer(shared_runs, qa_data, tmp_path):
    ours = rows(shared_runs.get(args(qa_data), name="qa-dp-1rank"))
    theirs = trainer_twin(qa_data, tmp_path / "hf")
    assert_same_steps(ours, theirs, "shardlab vs Trainer")
    # answer-only micro-batches carry different numbers of label tokens: a mean per micro-batch would differ here
    assert theirs[0]["lr"] == 0.0 and ours[1]["lr"] == pytest.approx(5e-4)  # warm-up from 0, the lr each step used


def test_two_ranks_equal_one_rank_with_twice_the_accumulation(shared_runs, qa_data):
    one = rows(shared_runs.get(args(qa_data, accum=8), name="qa-dp-1rank-accum8"))
    two = rows(shared_runs.get(args(qa_data, gpus=2), name="qa-dp-2rank"))
    assert_same_steps(two, one, "2 ranks x accum 4 vs 1 rank x accum 8")


@pytest.mark.parametrize("strategy, gpus", [("zero2", 1), ("zero2", 2), ("zero3", 2), ("fsdp", 2), ("pipeline", 2)])
def test_every_engine_weighs_tokens_as_dp(shared_runs, qa_data, strategy, gpus):
    """The pipeline's 2 ranks are 2 stages of one replica: its reference is dp on one rank (the same global batch)."""
    ref_gpus = 1 if strategy == "pipeline" else gpus
    ref = rows(shared_runs.get(args(qa_data, gpus=ref_gpus), name=f"qa-dp-{ref_gpus}rank"))
    run = rows(shared_runs.get(args(qa_data, strategy=strategy, gpus=gpus), name=f"qa-{strategy}-{gpus}rank"))
    assert_same_steps(run, ref, f"{strategy} on {gpus} rank(s) vs dp")
