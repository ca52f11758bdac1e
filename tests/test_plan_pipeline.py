"""`shardlab plan` for `--strategy pipeline`: the split is the strategy's own, each GPU's parameters are
those of the real stage modules, the micro-batches in flight are the simulator's (and torch's), and the
per-GPU peak matches a real pipeline step measured on CPU (tests/pipeline_memory_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlab.config import RunConfig, dump_config, load_config
from shardlab.errors import UserError
from shardlab.planning.arch import read_arch
from shardlab.planning.planner import plan
from shardlab.planning.strategy_plan import strategy_plan

PROBE = Path(__file__).with_name("pipeline_memory_probe.py")


def pp_plan(cfg: RunConfig, gpus: int, device: str = "cuda"):
    micro, accum, _ = cfg.resolve_batch(1)
    return strategy_plan("pipeline", read_arch(cfg), cfg.model_copy(update={"gpus": gpus}), micro, accum, "fp32", gpus, 1,
                         cfg.gradient_checkpointing, device)


@pytest.mark.parametrize("model,ranks,chunks", [("gpt2-medium", 2, 1), ("gpt2-medium", 4, 1), ("bloom-560m", 2, 1),
                                                ("bloom-560m", 4, 1), ("gpt2-medium", 2, 3), ("gpt2-medium", 2, "zbv"),
                                                ("gpt2-medium", 3, "zbv")])
def test_split_is_the_strategys(model, ranks, chunks):
    """PipelineStrategy.setup's own split, computed from the (meta) HF model, is the plan's; so is its placement
    (loop: stage s on GPU s % ranks; zbv's V: GPU d holds stages d and 2P-1-d)."""
    from transformers import AutoModelForCausalLM

    from shardlab.training.models import build_hf_config
    from shardlab.strategies.pipeline import model_parts, split_blocks

    zbv = chunks == "zbv"
    chunks = 2 if zbv else chunks
    opts = {"pp_schedule": "zbv"} if zbv else {"pp_schedule": "interleaved-1f1b", "pp_chunks": chunks} if chunks > 1 else {}
    cfg = RunConfig(model=model, seq_len=1024, micro_batch=1, grad_accum=4, strategy="pipeline", strategy_options=opts)
    with torch.device("meta"):
        model_meta = AutoModelForCausalLM.from_config(build_hf_config(cfg))
    _, _, blocks, _, _ = model_parts(model_meta)
    expected = split_blocks(model_meta.config, len(blocks), cfg.seq_len, ranks * chunks)  # what PipelineStrategy.setup calls
    sp = pp_plan(cfg, ranks)
    assert sorted(tuple(b) for st in sp.stages for b in st["blocks"]) == expected
    for st in sp.stages:  # loop placement: stage s on GPU s % ranks; zbv: d and 2P-1-d
        assert st["stages"] == ([st["gpu"], 2 * ranks - 1 - st["gpu"]] if zbv else list(range(st["gpu"], ranks * chunks, ranks)))
    if model == "bloom-560m" and ranks == 2:
        # The 250k-vocabulary head is 17.5 layers of FLOPs, ~37 with the loss (HEAD_COST_FACTOR): one block is left to it.
        assert expected == [(0, 23), (23, 24)]


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-bloom"])
def test_parameters_per_gpu_are_the_real_stage_modules(model):
    """Build the real model and the strategy's Stage modules; count what each GPU would hold."""
    from shardlab.training.models import build_model
    from shardlab.strategies.pipeline import Stage

    for ranks in (1, 2):
        cfg = RunConfig(model=model, device="cpu", seq_len=32, micro_batch=1, grad_accum=2, strategy="pipeline")
        sp = pp_plan(cfg, ranks)
        real = build_model(cfg)
        bounds = [tuple(b) for st in sp.stages for b in st["blocks"]]
        n_stages = len(bounds)
        for st in sp.stages:
            params = {}
            for s in st["stages"]:
                stage = Stage(real, *bounds[st["stages"].index(s)], first=s == 0, last=s == n_stages - 1)
                params.update({id(p): p.numel() for p in stage.parameters()})
            assert st["params"] == sum(params.values()), (model, ranks, st)
        # every parameter is on some GPU; a tied embedding is on two when first and last stage differ
        total = sum(st["params"] for st in sp.stages)
        tied = real.lm_head.weight is real.get_input_embeddings().weight
        extra = real.lm_head.weight.numel() if (tied and ranks > 1) else 0
        assert total == sum(p.numel() for p in real.parameters()) + extra


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_in_flight_micro_batches_are_the_simulators(schedule, chunks, ranks):
    """(micro-batch, stage) pairs whose activations a GPU holds at once: the plan's walk of torch's order is the
    simulator's sweep (zbv: held until each W)."""
    from shardlab.pipesim import simulate

    for M in (ranks, 2 * ranks):
        opts = {"pp_schedule": schedule, "pp_chunks": chunks}
        cfg = RunConfig(model="gpt2-medium", seq_len=256, micro_batch=1, grad_accum=M, strategy="pipeline", strategy_options=opts)
        sp = pp_plan(cfg, ranks)
        sim = simulate(schedule, stages=ranks, microbatches=M, chunks=chunks).metrics["peak_inflight"]
        assert [st["peak_in_flight"] for st in sp.stages] == sim
        if schedule == "gpipe":
            assert sim == [M] * ranks
        if schedule == "1f1b":  # stage s holds at most P - s
            assert sim == [min(M, ranks - s) for s in range(ranks)]


def test_one_f_one_b_needs_less_than_gpipe_and_the_worst_gpu_is_the_peak():
    base = dict(model="gpt2-medium", seq_len=1024, micro_batch=4, grad_accum=8, strategy="pipeline", precision="bf16", gpus=2)
    p1 = plan(RunConfig(**base), gpu_memory_gb=80, strategies=("pipeline",)).strategies["pipeline"]
    pg = plan(RunConfig(**base, strategy_options={"pp_schedule": "gpipe"}), gpu_memory_gb=80, strategies=("pipeline",)).strategies["pipeline"]
    assert p1.gpu_peak < 0.5 * pg.gpu_peak
    assert p1.gpu_peak == max(st["peak"] for st in p1.stages)
    assert any("each stage computes under autocast" in n for n in p1.notes)
    from shardlab.strategies.pipeline import step_keeps_outputs

    keeps = step_keeps_outputs()  # torch 2.13: step(return_outputs=False) frees each micro-batch's logits at its backward
    assert any("has no return_outputs to decline it" in n for n in p1.notes) == keeps
    assert p1.stages[-1]["logits_kept"] == (8 * 2 * 4 * 1024 * 50257 if keeps else 0)  # else M x 2·b·s·V of bf16 logits kept
    assert p1.max_micro_batch > 4


# gpt2-large, seq 1024, bf16, micro 4, 8 micro-batches, even splits, torch 2.11 (logits kept for schedule.step's
# return value): peak allocated GiB of the worst GPU, benchmarks/results/2026-11-21-h200x4-pipeline/rows.json.
H200_PIPELINE_RUNS = [("1f1b", [(0, 18), (18, 36)], 23.27), ("gpipe", [(0, 18), (18, 36)], 82.63),
                      ("1f1b", [(0, 9), (9, 18), (18, 27), (27, 36)], 20.66), ("gpipe", [(0, 9), (9, 18), (18, 27), (27, 36)], 47.68)]


@pytest.mark.parametrize("schedule,split,measured", H200_PIPELINE_RUNS)
def test_bf16_peak_matches_the_h200_pipeline_runs(monkeypatch, schedule, split, measured):
    """Autocast inside each stage: 16-bit activations, and a 16-bit copy of the stage's weights per micro-batch in
    flight. Counted as fp32 (the plan before), these cells were 15-22% over."""
    import shardlab.strategies.memory.pipeline as pp
    import shardlab.strategies.pipeline as strategy

    monkeypatch.setattr(pp, "pipeline_split", lambda *a: split)
    monkeypatch.setattr(strategy, "step_keeps_outputs", lambda: True)
    cfg = RunConfig(model="gpt2-large", strategy="pipeline", seq_len=1024, micro_batch=4, global_batch=32, precision="bf16",
                    strategy_options={"pp_schedule": schedule})
    sp = strategy_plan("pipeline", read_arch(cfg), cfg, 4, 8, "bf16", len(split), 1, False)
    assert sp.gpu_peak / 2**30 == pytest.approx(measured, rel=0.03)
    fp32 = strategy_plan("pipeline", read_arch(cfg), cfg, 4, 8, "fp32", len(split), 1, False)
    assert fp32.gpu_peak > 1.15 * sp.gpu_peak


def test_zbv_plan_holds_activations_until_w(monkeypatch):
    """zbv on 2 GPUs: GPU 0 holds the first and the last stage (embedding, LM head, the tied weight once), GPU 1 the two
    middle ones; its activations stay until each W, and from an I to its W the weights' output gradients join them,
    so a plan without those (a full backward releasing at I) would be lower. The peak is 1F1B's within 5% (the paper's
    claim is 1F1B's activation memory; planned 9.92 against 10.03 GiB): the band was 0.7x to 1.5x, which a zbv plan
    holding one more micro-batch in flight (+3.1 GiB on GPU 1, 1.3x) passed."""
    import shardlab.planning.strategy_plan as pp  # where each layer's activations are counted for the pipeline

    base = dict(model="gpt2-medium", seq_len=1024, micro_batch=2, grad_accum=8, strategy="pipeline", precision="bf16", gpus=2)
    zbv = plan(RunConfig(**base, strategy_options={"pp_schedule": "zbv"}), gpu_memory_gb=80, strategies=("pipeline",)).strategies["pipeline"]
    one = plan(RunConfig(**base), gpu_memory_gb=80, strategies=("pipeline",)).strategies["pipeline"]
    assert [st["stages"] for st in zbv.stages] == [[0, 3], [1, 2]]
    assert any("zbv: 2 stages per GPU in a V" in n for n in zbv.notes)
    assert [st["peak_in_flight"] for st in zbv.stages] == [4, 4]  # (micro-batch, chunk) pairs: 2 micro-batches' worth
    assert zbv.gpu_peak == pytest.approx(one.gpu_peak, rel=0.05)
    monkeypatch.setattr(pp, "weight_grad_input_bytes", lambda arch, mode: 0.0)
    without = plan(RunConfig(**base, strategy_options={"pp_schedule": "zbv"}), gpu_memory_gb=80, strategies=("pipeline",)).strategies["pipeline"]
    assert without.gpu_peak < zbv.gpu_peak


def test_pipeline_in_the_full_plan_and_bad_inputs(tmp_path):
    p = plan(RunConfig(model="tiny-gpt2", gpus=2, seq_len=64, micro_batch=2), gpu_memory_gb=16)
    assert "pipeline" in p.strategies and p.recommendation != "pipeline"
    p = plan(RunConfig(model="tiny-gpt2", gpus=4, seq_len=64, micro_batch=2), gpu_memory_gb=16)
    assert "pipeline" not in p.strategies
    assert any("pipeline left out: 4 pipeline stages but tiny-gpt2 has only 2 layers" in n for n in p.notes)
    with pytest.raises(UserError, match="only 2 layers"):
        plan(RunConfig(model="tiny-gpt2", gpus=4), gpu_memory_gb=16, strategies=("pipeline",))
    with pytest.raises(UserError, match="multiple of --stages"):
        plan(RunConfig(model="tiny-gpt2", gpus=3, strategy_options={"pp_stages": 2}), gpu_memory_gb=16, strategies=("pipeline",))
    # a Llama-style model is split like GPT-2/BLOOM; another family (GPT-NeoX) is left out with a note
    from transformers import GPTNeoXConfig, LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000).save_pretrained(tmp_path / "llama")
    p = plan(RunConfig(model=str(tmp_path / "llama"), gpus=2, seq_len=64, micro_batch=2), gpu_memory_gb=16)
    assert "pipeline" in p.strategies
    GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000).save_pretrained(tmp_path / "neox")
    p = plan(RunConfig(model=str(tmp_path / "neox"), gpus=2, seq_len=64, micro_batch=2), gpu_memory_gb=16)
    assert "pipeline" not in p.strategies and any("supports GPT-2, BLOOM and Llama-style models" in n for n in p.notes)
    with pytest.raises(UserError, match="unknown strategy 'pipe'"):
        plan(RunConfig(model="tiny-gpt2"), gpu_memory_gb=16, strategies=("pipe",))


# ---- a real pipeline step, measured -------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Small vocabulary, wide layers: the layers' activations dominate (the tiny presets are all logits)."""
    from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config

    root = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256,
                                                bos_token_id=0, eos_token_id=0)).save_pretrained(root / "gpt2")
    AutoModelForCausalLM.from_config(BloomConfig(n_layer=4, hidden_size=256, n_head=4, vocab_size=1000,
                                                 bos_token_id=0, eos_token_id=0)).save_pretrained(root / "bloom")
    return root


CASES = {
    "logits": dict(model="tiny-gpt2", schedule="1f1b"),  # kept M times on the last stage, concatenated at the end
    "layers": dict(model="gpt2", schedule="gpipe", dropout=0.1),  # M micro-batches in flight, dropout masks
    "interleaved": dict(model="bloom", schedule="interleaved-1f1b", chunks=2, ckpt=True),  # 4 virtual stages, recomputation
    "zbv": dict(model="gpt2", schedule="zbv"),  # 4 virtual stages in a V, activations and weights' output grads until W
}

# The interleaved case's measured CPU peak moves with the two ranks' timing: how many of the other rank's activations
# have already arrived (gloo's receive buffers) when stage 2 starts its backward. Seen on one 2-core machine for one
# tree: 35.3 MiB (3 of 4 full slow-tier runs, a busy machine) and 47.0 (alone), against a plan of 44.3 that counts
# every send kept until the step ends. Which ordering a run gets is the scheduler's, so this case asserts what a user
# relies on, that the plan does not fall short of the peak (8%: 5.7% alone), and is not more than 40% above it.
BAND = {"interleaved": (-0.08, 0.40)}


def case_config(case: dict, wide: Path) -> RunConfig:
    model = case["model"] if case["model"].startswith("tiny") else str(wide / case["model"])
    return load_config(None, {"model": model, "device": "cpu", "precision": "fp32", "strategy": "pipeline", "seq_len": 128,
                              "micro_batch": 2, "grad_accum": 4, "dropout": case.get("dropout", 0.0),
                              "gradient_checkpointing": case.get("ckpt", False), "strategy_options.pp_schedule": case["schedule"],
                              "strategy_options.pp_chunks": case.get("chunks", 2)})


@pytest.fixture(scope="module")
def measured(wide_models, tmp_path_factory):
    """Every case on the same 2 gloo ranks (the probe runs them one after the other)."""
    from shardlab.runtime.distributed import free_port

    out = tmp_path_factory.mktemp("probe")
    paths = []
    for name, case in CASES.items():
        (out / f"{name}.yaml").write_text(dump_config(case_config(case, wide_models)))
        paths.append(str(out / f"{name}.yaml"))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(PROBE), str(out / f"rank{r}.json"), *paths],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(CASES)}


@pytest.mark.slow  # two probe processes (a 2-rank pipeline step)
@pytest.mark.parametrize("name", list(CASES))
def test_peak_matches_a_measured_cpu_pipeline_step(name, measured, wide_models):
    case = CASES[name]
    cfg = case_config(case, wide_models)
    sp = pp_plan(cfg, 2, device="cpu")
    got = measured[name]
    assert [tuple(b) for b in got[0]["bounds"]] == sorted(tuple(b) for st in sp.stages for b in st["blocks"])
    for st, m in zip(sp.stages, got):
        err = st["peak"] / m["peak"] - 1
        print(f"{name} {case} GPU {st['gpu']}: predicted {st['peak'] / 2**20:.2f} MiB, measured {m['peak'] / 2**20:.2f} MiB "
              f"({err:+.1%}); {st['moment']}")
        low, high = BAND.get(name, (-0.06, 0.06))
        assert low < err < high, (case, st, m)
