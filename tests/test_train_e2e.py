"""`shardlab train` end to end on CPU: every strategy trains, agrees with DDP, exports, resumes.

Each run is a `python -m shardlab train` subprocess (gloo workers for --gpus N), made once per
pytest run by the session's `shared_runs` registry (conftest.py) and read by several tests. Runs use fp32, dropout 0 and the same
seed and data, so strategies that only move memory around must produce the same losses.

The runs use a constant learning rate (the 2-rank ones after 3 warm-up steps, so the engines'
schedulers are compared too): then the first 14 steps of a 20-step run *are* an uninterrupted
14-step run, which the resume tests compare against. The cosine shape is unit-tested in
test_config.py.
"""

from __future__ import annotations

import json
import os
import math
import statistics
from pathlib import Path

import pytest

STRATEGIES_1 = ["dp", "zero0", "zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload", "fsdp", "fsdp_offload"]
STRATEGIES_2 = ["dp", "zero2", "zero3", "fsdp", "zero2_offload"]
N_PARAMS_TINY_GPT2 = 3_382_080
FAST = ("dp", "zero2", "fsdp")  # the fast tier's single-rank runs (conftest.py): one per engine family


def tiered(strategies):
    """Parameters for STRATEGIES_1 tests: the other strategies' runs belong to the slow tier."""
    return [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in strategies]


# 32 tokens a sequence: tiny-gpt2's step is its 50257-word head and softmax, linear in the tokens, and these runs
# test what the strategies do, not how long sequences train (32 instead of 64 took 0.22 instead of 0.37 s a step).
SEQ = 32


def train_args(*, model="tiny-gpt2", steps=20, gpus=1, strategy="dp", extra=()):
    args = [
        "--model", model, "--strategy", strategy, "--max-steps", str(steps),
        "--seq-len", str(SEQ), "--micro-batch", "2", "--lr", "1e-3", "--dropout", "0", "--precision", "fp32",
        "--log-every", "1", "--seed", "1234",
        "--set", "dataset.eval_samples=1",  # a few eval blocks keep epoch-end eval cheap
    ]  # fmt: skip
    if gpus == 1:
        args += ["--lr-schedule", "constant"]
    else:  # warm-up, so the engines' schedulers are compared too; constant after it, so resume has a reference
        args += ["--gpus", str(gpus), "--grad-accum", "2", "--warmup-steps", "3", "--lr-schedule", "constant"]
    return args + list(extra)


class Runs:
    """Names for this module's runs in the session's `shared_runs` registry (conftest.py): each configuration
    trains once per pytest run, however many tests (in any module) read it."""

    def __init__(self, shared):
        self.shared = shared
        self.root = shared.root

    def get(self, name: str, args: list[str], out: Path | None = None, prepare=None):
        """`shardlab train ARGS` into a new directory called NAME, or into OUT (a resume into an earlier run)."""
        return self.shared.get(args, name=name, out=out, prepare=prepare)

    def strategy(self, strategy: str, gpus: int = 1):
        extra = ["--nvme-path", str(self.root / "nvme")] if strategy == "infinity" else []
        return self.get(f"{strategy}-{gpus}rank", train_args(strategy=strategy, gpus=gpus, extra=extra))


@pytest.fixture(scope="session")  # a view of the session's registry: no module group of its own (conftest.py)
def runs(shared_runs):
    return Runs(shared_runs)


def assert_trained(run, *, steps: int, world: int, strategy: str, grad_accum: int = 1, micro: int = 2, seq: int = SEQ, loss_falls: bool = True):
    run.check()
    rows = run.rows
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["lr"] > 0 or (world > 1 and r["step"] == 1)  # the 2-rank runs warm up from lr 0, as transformers does
        assert r["grad_norm"] is not None and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
    first, last = statistics.fmean(run.losses[:5]), statistics.fmean(run.losses[-5:])
    assert last < first or not loss_falls, f"{strategy}: loss did not fall ({first:.4f} -> {last:.4f}): {run.losses}"

    s = run.summary
    assert s["strategy"] == strategy and s["model"] == run.config["model"]
    assert s["steps"] == steps and s["world_size"] == world and s["precision"] == "fp32" and s["device_type"] == "cpu"
    assert (s["micro_batch"], s["grad_accum"], s["global_batch"]) == (micro, grad_accum, micro * grad_accum * world)
    assert s["tokens_per_step"] == s["global_batch"] * seq
    assert s["tokens_per_s"] > 0 and s["useful_tokens_per_s"] > 0 and s["samples_per_s"] > 0 and s["step_time_median_s"] > 0
    assert s["final_train_loss"] == pytest.approx(rows[-1]["loss"])
    assert math.isfinite(s["final_eval_loss"]) and s["final_eval_ppl"] == pytest.approx(math.exp(s["final_eval_loss"]))
    assert s["non_pad_fraction"] == 1.0 and s["n_params"] > 0 and s["total_time_s"] > 0
    assert s["epochs"] and s["epochs"][0]["steps"] == steps

    env = json.loads((run.out / "env.json").read_text())
    assert env["world_size"] == world and env["precision"] == "fp32" and env["backend"] == "gloo"
    assert run.config["strategy"] == strategy and run.config["global_batch"] == s["global_batch"]
    model_dir = run.out / "model"
    assert (model_dir / "config.json").is_file() and list(model_dir.glob("*.safetensors"))
    assert not (run.out / "model.tmp").exists()


# ---- every strategy, one rank ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", tiered(STRATEGIES_1))
def test_single_rank_trains(runs, strategy):
    run = runs.strategy(strategy)
    assert_trained(run, steps=20, world=1, strategy=strategy)
    assert run.summary["n_params"] == N_PARAMS_TINY_GPT2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES_2)
def test_two_ranks_train_with_accumulation(runs, strategy):
    run = runs.strategy(strategy, gpus=2)
    assert_trained(run, steps=20, world=2, strategy=strategy, grad_accum=2)
    assert "launching 2 worker(s)" in run.stdout
    # each rank computes with its share of the cores, not all of them (oversubscribed threads spin against each other)
    cores = len(os.sched_getaffinity(0))
    assert run.summary["cpu_threads"] == max(1, cores // 2) and run.summary["bound_cores"] == (cores // 2 if cores >= 2 else 0)
    # 3 warm-up steps from 0 (transformers' schedules); each row's lr is the one its step used
    assert [r["lr"] for r in run.rows] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3] + [1e-3] * 17)


# ---- equivalence: a strategy changes memory, not the mathematics ------------------------------------------


def assert_same_losses(run, ref, n=10, rel=1e-3):
    run.check(), ref.check()
    got, want = run.rows[:n], ref.rows[:n]
    assert len(got) == len(want) == n
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel), f"step {a['step']}: {a['loss']} vs dp {b['loss']}"
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6), f"step {a['step']}: lr {a['lr']} vs dp {b['lr']}"


@pytest.mark.parametrize("strategy", tiered(s for s in STRATEGIES_1 if s != "dp"))
def test_single_rank_losses_match_dp(runs, strategy):
    run = runs.strategy(strategy)
    assert_same_losses(run, runs.strategy("dp"))
    if strategy == "zero3":  # with one-rank ZeRO-3's defaults: GPT2Block leaves, no contiguous gradients (issue 15)
        zero = run.summary["zero_optimization"]
        assert zero["leaf_module"]["classes"][-1] == "GPT2Block" and zero["contiguous_gradients"] is False


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES_2 if s != "dp"])
def test_two_rank_losses_match_dp(runs, strategy):
    run = runs.strategy(strategy, gpus=2)
    assert_same_losses(run, runs.strategy("dp", gpus=2))
    if strategy == "zero3":  # block leaves on several ranks too: each block gathered and hooked as one module
        assert run.summary["zero_optimization"]["leaf_module"]["classes"][-1] == "GPT2Block"
        assert_zero3_norm_is_dps(run, runs.strategy("dp", gpus=2))
    if strategy == "fsdp":  # tiny-gpt2's two blocks hold far fewer parameter-tokens than a unit is given: one unit
        assert "one unit per 2 blocks + the root" in run.stdout + run.stderr
    if strategy == "zero2_offload":  # the workers read the config from a file and still size the buckets: hidden^2
        assert run.config["model"] == "tiny-gpt2" and run.summary["zero_optimization"]["reduce_bucket_size"] == 64**2


@pytest.mark.slow
def test_fsdp_explicit_prefetch_matches_dp(runs):
    """fsdp_prefetch issues the next blocks' gathers early (forward) and the previous blocks' (backward): same losses.
    What each block is told to prefetch is checked on stand-in blocks (the run's own FSDP2 units are in its workers):
    the run's config echoing the option back, which this asserted before, held whatever set_prefetch did."""
    from shardlab.strategies.fsdp import set_prefetch

    class Block:
        def __init__(self, i):
            self.i, self.forward, self.backward = i, None, None

        def set_modules_to_forward_prefetch(self, modules):
            self.forward = [m.i for m in modules]

        def set_modules_to_backward_prefetch(self, modules):
            self.backward = [m.i for m in modules]

    blocks = [Block(i) for i in range(4)]
    set_prefetch(blocks, 2)
    assert [b.forward for b in blocks] == [[1, 2], [2, 3], [3], None]  # the next two, in forward order
    assert [b.backward for b in blocks] == [None, [0], [1, 0], [2, 1]]  # the two before, in backward order
    run = runs.get("fsdp-prefetch-2rank", train_args(strategy="fsdp", gpus=2, extra=[
        "--set", "strategy_options.fsdp_prefetch=2", "--set", "strategy_options.fsdp_blocks_per_unit=1"]))  # a unit a block
    assert "one unit per block + the root" in run.stdout + run.stderr
    assert_same_losses(run, runs.strategy("dp", gpus=2))


@pytest.mark.slow
@pytest.mark.parametrize("name, strategy, extra", [
    ("zero3", "zero3", []),
    ("fsdp", "fsdp", ["--set", "strategy_options.fsdp_prefetch=1", "--set", "strategy_options.fsdp_blocks_per_unit=1"]),
    ("fsdp-grouped", "fsdp", []),  # both blocks in one unit (fsdp.blocks_per_unit)
])
def test_three_ranks_match_dp(runs, name, strategy, extra):
    """Three ranks, with partitions that do not split evenly: ZeRO-3's block leaves, FSDP2's explicit prefetch (a unit
    a block) and FSDP2's units of several blocks."""
    run = runs.get(f"{name}-3rank", train_args(strategy=strategy, gpus=3, steps=10, extra=extra))
    if strategy == "fsdp":
        assert ("one unit per 2 blocks" in run.stdout + run.stderr) is (name == "fsdp-grouped")
    dp = runs.get("dp-3rank", train_args(strategy="dp", gpus=3, steps=10))
    assert_same_losses(run, dp)
    if strategy == "zero3":
        assert_zero3_norm_is_dps(run, dp)


def assert_zero3_norm_is_dps(run, dp) -> None:
    """ZeRO-3 on several ranks takes its gradient norm with compat/zero3_norm.py (each rank's partitions' squares,
    all-reduced) and without contiguous gradients: the norm clipping reads is dp's (whole gradients, one rank each)."""
    assert "foreach_norm" in run.summary["patches"] and run.summary["zero_optimization"]["contiguous_gradients"] is False
    for a, b in zip(run.rows, dp.rows):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (a["step"], a["grad_norm"], b["grad_norm"])


# ---- ZeRO-Infinity (NVMe swap) ------------------------------------------------------------------------


def _aio_compatible() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


@pytest.mark.slow
def test_infinity_trains_with_nvme_swap(runs, monkeypatch):
    # DeepSpeed's op builder, in this process, on the CPU accelerator; the variable only while it runs: the session's
    # zygote has none, and a command asked for with another environment runs in a real interpreter (tests/zygote.py),
    # which cost the infinity run below ~14 s of imports.
    if "DS_ACCELERATOR" not in os.environ:
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    if not _aio_compatible():
        pytest.skip("DeepSpeed's async_io op is not compatible here (libaio-dev missing?), so ZeRO-Infinity cannot swap to NVMe")
    # JIT-build the op here, outside the run's time limit: on a fresh machine (empty ~/.cache/torch_extensions) its first
    # build takes over 7 minutes on 2 busy cores and timed the 420 s run out in CI (2026-11-26); the run then loads it.
    from deepspeed.ops.op_builder import AsyncIOBuilder

    AsyncIOBuilder().load(verbose=False)
    monkeypatch.undo()
    run = runs.strategy("infinity")
    assert_trained(run, steps=20, world=1, strategy="infinity")
    swap = runs.root / "nvme"
    assert swap.is_dir() and any(swap.rglob("*")), "nothing was swapped to the NVMe path"
    assert_same_losses(run, runs.strategy("dp"))


def test_nvme_path_checks(tmp_path):
    from shardlab.errors import UserError
    from shardlab.strategies.deepspeed_machine import check_nvme_path

    ok = check_nvme_path(str(tmp_path / "new" / "swap"), 1000)
    assert ok.is_dir() and not list(ok.iterdir())  # created, and the write probe cleaned up
    with pytest.raises(UserError, match="needs an NVMe directory"):
        check_nvme_path(None, 1000)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "below"):
        with pytest.raises(UserError, match="not writable") as err:
            check_nvme_path(str(bad), 1000)
        assert str(bad) in str(err.value)
    with pytest.raises(UserError, match=r"GiB free but ZeRO-Infinity needs about") as err:
        check_nvme_path(str(tmp_path / "swap"), 10**15)  # 14 PB of optimizer state
    assert "free space" in str(err.value)
    with pytest.raises(UserError, match="GiB free"):
        check_nvme_path(str(tmp_path / "swap"), 1, extra_gb=1e9)


# ---- BLOOM ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_bloom_trains(runs):
    # (an earlier run's files in the output dir are refused, or replaced with --overwrite: test_cli_mistakes)
    run = runs.get("bloom", train_args(model="tiny-bloom", steps=10, strategy="dp", extra=["--eval-every", "5"]))
    # 10 noisy steps of batch 2 are too few for the train loss to fall reliably; the fixed eval set shows it
    assert_trained(run, steps=10, world=1, strategy="dp", loss_falls=False)
    evals = [r for r in run.all_rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 5, 10]  # step 0: the eval before training (eval_at_start)
    # With the held-out split deduplicated against training, 10 steps of batch 2 move a random-init model's held-out
    # loss by noise (10.837 -> 10.842 -> 10.845 measured): each eval is finite and near a uniform guess, log(vocab).
    for r in evals:
        assert abs(r["eval_loss"] - math.log(50257)) < 0.1, evals
    assert run.summary["initial_eval_loss"] == evals[0]["eval_loss"]
    config = json.loads((run.out / "model" / "config.json").read_text())
    assert config["model_type"] == "bloom" and config["architectures"] == ["BloomForCausalLM"]
    assert run.summary["patches"] == ["bloom_sdpa"] and run.summary["patches_off"] is None  # compat/bloom_sdpa.py


@pytest.mark.slow
def test_a_patch_switched_off_is_said_once_and_the_run_records_it(runs, train_cli, tmp_path, monkeypatch):
    """SHARDLAB_PATCHES=-bloom_sdpa: one line says so, BLOOM trains with transformers' eager attention, and summary.json
    lists the patch as off, with why. The losses are the patched run's (tests/test_compat.py checks them closely)."""
    # The shared patched run first: a registry run trained under this test's environment would be the unpatched one
    # for every later asker (test_tiny_bloom_trains).
    patched = runs.get("bloom", train_args(model="tiny-bloom", steps=10, strategy="dp", extra=["--eval-every", "5"])).check()
    monkeypatch.setenv("SHARDLAB_PATCHES", "-bloom_sdpa")
    run = train_cli(train_args(model="tiny-bloom", steps=10, strategy="dp", extra=["--eval-every", "5"]), tmp_path / "run").check()
    assert [line for line in run.stdout.splitlines() if "patch bloom_sdpa off" in line] == [
        "[shardlab] patch bloom_sdpa off: turned off by SHARDLAB_PATCHES; instead transformers' eager BLOOM attention"]
    assert run.summary["patches"] == [] and run.summary["patches_off"] == {"bloom_sdpa": "turned off by SHARDLAB_PATCHES"}
    for a, b in zip(run.rows, patched.rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a, b)


# ---- export: the HF directory reproduces the run's eval loss ------------------------------------------------


@pytest.mark.parametrize("strategy,gpus", [("dp", 1), pytest.param("zero3", 2, marks=pytest.mark.slow), pytest.param("fsdp", 2, marks=pytest.mark.slow)])
def test_export_reloads_and_reproduces_eval_loss(runs, trainer_eval_loss, strategy, gpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlab.config import load_config
    from shardlab.data import build_datasets
    from shardlab.training.tokenizing import load_tokenizer

    run = runs.strategy(strategy, gpus).check()
    assert run.summary["export_dir"] == str(run.out / "model")
    model = AutoModelForCausalLM.from_pretrained(run.out / "model").eval()
    tok = AutoTokenizer.from_pretrained(run.out / "model")
    assert sum(p.numel() for p in model.parameters()) == run.summary["n_params"]  # full tensors, not shards

    cfg = load_config(run.out / "config.yaml")
    ref_tok = load_tokenizer(cfg)
    text = "def train(model):\n    return model  # shardlab"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    splits = build_datasets(cfg.dataset, ref_tok, cfg.seq_len, cfg.seed)
    assert splits.eval is not None and len(splits.eval) > 0
    loss = trainer_eval_loss(model, splits.eval, run.summary["world_size"])
    assert loss == pytest.approx(run.summary["final_eval_loss"], rel=1e-4)


# ---- checkpoints and resume -----------------------------------------------------------------------------

# zero3 on one rank: a checkpoint saved and loaded between steps whose parameters stay gathered (compat/zero3_one_rank.py)
RESUMABLE = [("dp", 1), ("zero2", 1), ("fsdp", 1), ("zero3", 2), ("zero3", 1)]


def resume_runs(runs, strategy, gpus):
    """10 steps saving every 5, then `--max-steps 14 --resume auto` into the same output dir."""
    name = f"resume-{strategy}-{gpus}rank"
    first = runs.get(name, train_args(strategy=strategy, gpus=gpus, steps=10, extra=["--save-every", "5"]))
    first.check()
    again = train_args(strategy=strategy, gpus=gpus, steps=14, extra=["--resume", "auto"])

    def killed_at_step_12():  # as if the job had been killed at step 12, after logging two steps past its last checkpoint
        assert [r["step"] for r in first.rows] == list(range(1, 11))
        with open(first.out / "metrics.jsonl", "a") as f:  # and in the middle of writing step 13's row (a torn line)
            f.write(json.dumps({"step": 11, "loss": 0.5}) + "\n" + json.dumps({"step": 12, "loss": 0.5}) + "\n" + '{"step": 13, "lo')

    second = runs.get(f"{name}-continued", again, out=first.out, prepare=killed_at_step_12)
    return first, second


@pytest.mark.slow
@pytest.mark.parametrize("strategy,gpus", RESUMABLE)
def test_checkpoints_are_written(runs, strategy, gpus):
    first, _ = resume_runs(runs, strategy, gpus)
    root = first.out / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-0000005", "step-0000010"]
    assert (root / "latest").read_text().strip() == "step-0000010"
    assert not list(root.glob("*.tmp*"))
    state = json.loads((root / "step-0000010" / "trainer_state.json").read_text())
    assert state["global_step"] == 10 and state["stage"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy,gpus", RESUMABLE)
def test_resume_continues_like_an_uninterrupted_run(runs, strategy, gpus):
    first, second = resume_runs(runs, strategy, gpus)
    second.check()
    assert "resumed from" in second.stdout and "step-0000010" in second.stdout
    rows = second.rows  # the resumed run appends to the first run's metrics.jsonl
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert second.summary["steps"] == 14
    straight = runs.strategy(strategy, gpus).check()  # constant lr: its first 14 steps are a 14-step run
    for r in rows:
        want = straight.rows[r["step"] - 1]["loss"]
        assert r["loss"] == pytest.approx(want, rel=1e-4), f"{strategy} step {r['step']}: {r['loss']} vs uninterrupted {want}"


@pytest.mark.slow
def test_resume_with_another_weight_decay_is_refused(runs, train_cli, tmp_path):
    """The optimizer state holds the weight decay it was written with (a new value would be ignored),
    and decay 0 is one parameter group, not two: the launcher refuses before any worker starts."""
    import shutil

    first, _ = resume_runs(runs, "dp", 1)
    out = tmp_path / "copy"
    shutil.copytree(first.out, out)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    run = train_cli(train_args(steps=14, extra=["--resume", "auto", "--weight-decay", "0.1"]), out)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "written with weight decay 0.0, this run uses 0.1" in lines[0] and "--weight-decay 0.0" in lines[0], run.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


# ---- data formats: QA with answer-only loss, curriculum ------------------------------------------------------


@pytest.mark.slow
def test_qa_answer_only_loss_with_padding(runs, tmp_path):
    data = tmp_path / "qa.jsonl"
    cities = ["Paris", "Rome", "Madrid", "Berlin", "Vienna", "Lisbon", "Athens", "Dublin", "Oslo", "Prague"]
    rows = []
    for i in range(60):
        city = cities[i % len(cities)]
        rows.append({
            "question": f"Which city is number {i} on the list?",
            "context": f"The list has many cities. Number {i} on the list is {city}, a capital in Europe.",
            "answer": city,
        })  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = runs.get("qa", [
        "--model", "tiny-gpt2", "--dataset", str(data), "--format", "qa", "--answer-only-loss", "--packing", "pad",
        "--seq-len", "64", "--micro-batch", "2", "--max-steps", "8", "--lr", "1e-3", "--dropout", "0", "--log-every", "1",
    ]).check()  # fmt: skip
    assert [r["step"] for r in run.rows] == list(range(1, 9))
    assert all(math.isfinite(x) for x in run.losses)
    s = run.summary
    assert 0 < s["non_pad_fraction"] < 1  # each example padded to 64 tokens
    assert s["useful_tokens_per_s"] < s["tokens_per_s"]
    assert run.config["dataset"]["format"] == "qa" and run.config["dataset"]["answer_only_loss"] is True
    assert "non-pad" in run.stdout


@pytest.mark.slow
def test_curriculum_trains_through_both_stages(runs, tmp_path):
    text = tmp_path / "notes.txt"
    paragraphs = [f"Note {i}: sharding splits the optimizer state of model {i} across {i % 7 + 2} ranks, then gathers it." for i in range(120)]
    text.write_text("\n\n".join(paragraphs) + "\n")
    cfg = tmp_path / "curriculum.yaml"
    cfg.write_text(
        f"""
model: tiny-gpt2
seq_len: 64
micro_batch: 2
lr: 1e-3
lr_schedule: constant
dropout: 0
precision: fp32
log_every: 1
curriculum:
  - name: docs
    dataset: {{source: offline, eval_samples: 1}}
    max_steps: 4
  - name: notes
    dataset: {{source: {text}}}
    max_steps: 3
"""
    )
    run = runs.get("curriculum", ["--config", str(cfg)]).check()
    assert [(r["step"], r["stage"]) for r in run.rows] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1), (7, 1)]
    assert run.summary["steps"] == 7
    assert [e["stage"] for e in run.summary["epochs"]] == [0, 1]
    assert "stage docs" in run.stdout and "stage notes" in run.stdout
    assert run.config["curriculum"][1]["dataset"]["source"] == str(text)


@pytest.mark.slow
def test_compiled_per_block_matches_eager(runs, monkeypatch):
    """compile_scope=blocks (each decoder block compiled on its own, training/compiling.py) changes speed, not the
    losses; the summary says which scope ran. Backend aot_eager (SHARDLAB_COMPILE_BACKEND): what is tested is which
    modules are compiled and that they train alike; inductor's CPU code for a whole model is test_compile_stats's."""
    from shardlab.training import compiling

    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")
    run = runs.get("dp-compile-blocks-1rank", train_args(strategy="dp", steps=6, extra=["--compile", "--set", "compile_scope=blocks"]))
    run.check()
    assert run.summary["compile"] is True and run.summary["compile_scope"] == "blocks"
    assert_same_losses(run, runs.strategy("dp"), n=6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_deepspeed_compile_matches_eager(runs, train_cli, tmp_path, monkeypatch, strategy):
    """--compile with a DeepSpeed strategy is DeepSpeed's own engine.compile: dynamo and AOTAutograd through the
    engine's hooks (ZeRO-3's gathers included) change speed, not the losses. Backend aot_eager
    (SHARDLAB_COMPILE_BACKEND): inductor's C++ compile is minutes on 2 cores, and test_compile_stats runs it (whole model, dp)."""
    from shardlab.training import compiling

    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")
    run = train_cli(train_args(strategy=strategy, steps=6, extra=["--compile"]), tmp_path / "run")
    run.check()
    assert run.summary["compile"] is True and run.summary["compile_time_s"] > 0
    if strategy == "zero3":  # torch's F.linear under compile (strategies/deepspeed_config.plain_linear_under_compile)
        assert run.summary["zero_optimization"]["memory_efficient_linear"] is False
    assert_same_losses(run, runs.strategy(strategy), n=6)


@pytest.mark.slow
def test_zero3_compile_keeps_every_layer_compiled(train_cli, tmp_path, monkeypatch):
    """DeepSpeed's hooks break ZeRO-3's compiled model at each module, and dynamo compiles each hook once per module (on
    the GPU a decoder layer's forward once per layer too): at its default recompile_limit (8) the ninth on ran eagerly,
    with a warning (training/compiling.py: room_for_each_block). A 10-layer Llama compiles them all, and trains as eager
    does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlab.training import compiling

    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=10, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama10")
    args = ["--model", str(tmp_path / "llama10"), "--strategy", "zero3", "--max-steps", "3", "--seq-len", "32",
            "--micro-batch", "2", "--dataset", "synthetic", "--eval-split", "0", "--no-export", "--precision", "fp32",
            "--log-every", "1", "--dropout", "0"]
    compiled = train_cli([*args, "--compile"], tmp_path / "compiled").check()
    assert "recompile_limit" not in compiled.stderr + compiled.stdout, compiled.stderr[-2000:]
    assert_same_losses(compiled, train_cli(args, tmp_path / "eager").check(), n=3)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, gpus", [("dp", 1), ("zero3", 2), ("fsdp", 2)])
def test_compiled_loss_kernel_matches_the_models_own_loss(runs, strategy, gpus):
    """loss_kernel=compiled (the loss outside the model, torch.compile'd) changes memory and speed, not the losses;
    zero3 and fsdp on 2 ranks: the logits leave the engines' sharded forward and the loss is taken outside them."""
    run = runs.get(f"{strategy}-{gpus}rank-compiled-loss", train_args(strategy=strategy, gpus=gpus, steps=6, extra=["--set", "loss_kernel=compiled"]))
    run.check()
    assert run.summary["loss_kernel"] == "compiled" and runs.strategy(strategy, gpus).summary["loss_kernel"] == "hf"
    assert_same_losses(run, runs.strategy(strategy, gpus), n=6, rel=1e-5)
