"""--master-weights bf16 (dp): bf16 weights and gradients, torchao AdamW8bit rounding stochastically; the plan's
model of it and its recommendation when nothing exact fits; the tokenizer/embedding check it brought up."""

from __future__ import annotations

import pytest
import torch

from shardlab.config import DatasetConfig, RunConfig
from shardlab.data import build_datasets
from shardlab.errors import UserError
from shardlab.planning import planner
from shardlab.planning.arch import read_arch
from shardlab.planning.strategy_plan import predict_cpu_run, strategy_plan
from shardlab.runtime.resolved import assumed_run
from shardlab.strategies import strategy_class
from shardlab.training import optim
from shardlab.training.tokenizing import load_tokenizer

GiB = 2**30
BF16 = {"precision": "bf16", "optimizer": "adamw8bit", "master_weights": "bf16"}


def check(strategy="dp", device="cpu", **kw):
    cfg = RunConfig(strategy=strategy, **kw)
    strategy_class(strategy).check_options(assumed_run(cfg, device, world=1, accum=1))


@pytest.mark.parametrize(("strategy", "kw", "needle"), [
    ("fsdp", BF16, "not supported with strategy 'fsdp'"),
    ("zero2", {**BF16, "optimizer": "adamw"}, "not supported with strategy 'zero2'"),
    ("dp", {**BF16, "optimizer": "adamw"}, "needs --optimizer adamw8bit"),
    ("dp", {**BF16, "precision": "fp32"}, "needs bf16 compute, not fp32"),
    ("dp", {**BF16, "precision": "auto"}, "needs bf16 compute, not fp32"),  # auto on a CPU is fp32
])
def test_bf16_master_weights_are_refused_where_they_cannot_work(strategy, kw, needle):
    with pytest.raises(UserError) as err:
        check(strategy, **kw)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bf16_master_weights_pass_on_dp_and_say_what_they_compute():
    check("dp", **BF16)
    check("dp", **BF16, optimizer_in_backward=True, max_grad_norm=None)
    said = optim.arithmetic(RunConfig(**BF16))
    assert "8-bit AdamW" in said and "bf16 weights and gradients" in said and "stochastically" in said
    assert optim.eight_bit_kwargs(RunConfig(**BF16)) == {"bf16_stochastic_round": True}
    assert optim.eight_bit_kwargs(RunConfig(optimizer="adamw8bit")) == {}


def test_the_optimizers_round_stochastically_into_bf16_weights():
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    whole = optim.build(model, RunConfig(**BF16), "cpu")
    assert whole.bf16_stochastic_round
    per_param = optim.build(model, RunConfig(**BF16, optimizer_in_backward=True, max_grad_norm=None), "cpu")
    assert all(o.bf16_stochastic_round for o in per_param.optimizers.values())


def _dp(cfg: RunConfig):
    arch = read_arch(cfg)
    micro, accum, _ = cfg.resolve_batch(1)
    return arch, strategy_plan("dp", arch, cfg, micro, accum, "bf16", 1, 1, cfg.gradient_checkpointing)


def test_plan_counts_bf16_weights_and_grads_without_autocast_copies():
    base = dict(model="gpt2-medium", seq_len=256, micro_batch=2, optimizer="adamw8bit", precision="bf16")
    arch, fp32 = _dp(RunConfig(**base))
    _, bf16 = _dp(RunConfig(**base, master_weights="bf16"))
    n = arch.n_params
    assert fp32.gpu["parameters"] == 4 * n and bf16.gpu["parameters"] == 2 * n
    assert fp32.gpu["gradients"] == 4 * n and bf16.gpu["gradients"] == 2 * n
    assert bf16.gpu["optimizer"] == fp32.gpu["optimizer"]  # the same 8-bit moments (2 B/param + block scales)
    assert not any("autocast" in note for note in bf16.notes) and any("autocast" in note for note in fp32.notes)
    # On a GPU the bf16 model is built on meta and materialised there: nothing on the host at load time
    assert bf16.cpu_detail["model built on meta, materialised on the GPU (load time)"] == 0
    assert fp32.cpu_detail["model built on meta, materialised on the GPU (load time)"] == 0
    cpu, _ = predict_cpu_run(RunConfig(**base, device="cpu", master_weights="bf16"), 1, reuse_heap=True)
    assert cpu.cpu_detail["model built in bf16 on the CPU (load time)"] == 2 * n
    assert bf16.gpu_peak < fp32.gpu_peak - 4 * n  # 2 B/param of weights, 2 of grads, and the 2 of autocast copies less


def test_plan_recommends_the_lightest_option_that_fits_when_no_exact_adamw_strategy_does():
    """llama-2-13b on one 80 GB GPU with a 125 GiB host and 55 GB of disk (the H100 machine): no exact-AdamW strategy
    fits; 8-bit AdamW in backward on fp32 weights (6 B/param: 78 GB) does not either; bf16 weights (4 B/param) do."""
    cfg = RunConfig(model="llama-2-13b", seq_len=1024, micro_batch=16, precision="bf16", gradient_checkpointing=True,
                    loss_kernel="liger")
    p = planner.plan(cfg, gpu_memory_gb=79.2, host_ram_gb=125, nvme_free_gb=55)
    assert not any(sp.fits for sp in p.strategies.values())
    assert p.recommendation == "dp" and p.recommended_flags is not None
    assert "--optimizer adamw8bit --optimizer-in-backward --master-weights bf16" in p.recommended_flags
    assert "--grad-accum 1" in p.recommended_flags and "max_grad_norm=null" in p.recommended_flags
    micro = int(p.recommended_flags.split("--micro-batch ")[1].split()[0])
    assert 1 <= micro <= 16 and p.recommended_plan.gpu_peak < 79.2 * GiB
    assert "not bit-exact" in p.reason
    # A model that fits with exact AdamW keeps the exact recommendation
    small = planner.plan(RunConfig(model="gpt2", seq_len=256, micro_batch=2, precision="bf16"), gpu_memory_gb=79.2, host_ram_gb=125)
    assert small.recommended_flags is None and small.recommendation is not None


def test_a_tokenizer_larger_than_the_embedding_is_refused_for_text_and_synthetic_ids_stay_below_it(tmp_path):
    tok = load_tokenizer(RunConfig(model="tiny-gpt2"))  # 50,257 tokens
    text = tmp_path / "t.txt"
    text.write_text("hello world. " * 200)
    with pytest.raises(UserError) as err:
        build_datasets(DatasetConfig(source=str(text)), tok, 16, 0, cache_dir=tmp_path / "c", model_vocab=32000)
    assert "50,257 tokens but the model embeds only 32,000" in str(err.value) and "--tokenizer" in str(err.value)
    syn = build_datasets(DatasetConfig(source="synthetic", synthetic_tokens=4096), tok, 16, 0, cache_dir=tmp_path / "c",
                         model_vocab=1000)
    ids = torch.cat([torch.as_tensor(syn.train[i]["input_ids"]) for i in range(len(syn.train))])
    assert int(ids.max()) < 1000 and "vocab 1000" in syn.stats["source"]
    same = build_datasets(DatasetConfig(source="synthetic", synthetic_tokens=4096), tok, 16, 0, cache_dir=tmp_path / "c",
                          model_vocab=60000)  # a larger embedding changes nothing
    ids = torch.cat([torch.as_tensor(same.train[i]["input_ids"]) for i in range(len(same.train))])
    assert int(ids.max()) >= 1000 and "vocab 50257" in same.stats["source"]


@pytest.mark.slow
def test_a_bf16_master_run_trains_with_bf16_weights(tmp_path, train_cli):
    """tiny-gpt2 on the offline corpus, bf16 weights and 8-bit AdamW: the loss falls and the exported weights are bf16."""
    args = ["--model", "tiny-gpt2", "--max-steps", "12", "--seq-len", "32", "--micro-batch", "4", "--lr", "3e-3",
            "--precision", "bf16", "--optimizer", "adamw8bit", "--master-weights", "bf16", "--log-every", "1",
            "--lr-schedule", "constant", "--set", "dataset.eval_samples=1"]  # fmt: skip
    run = train_cli(args, tmp_path / "bf16", timeout=1200).check()
    assert "bf16 weights and gradients" in run.summary["optimizer"]
    assert sum(run.losses[-3:]) < sum(run.losses[:3])
    from safetensors import safe_open

    export = next((tmp_path / "bf16").rglob("model.safetensors"))
    with safe_open(str(export), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def _strategy(cls, cfg, device):
    from types import SimpleNamespace

    st = cls.__new__(cls)
    st.cfg, st.env = cfg, SimpleNamespace(device=torch.device(device))
    return st


@pytest.mark.parametrize(("model", "dtype"), [("tiny-gpt2", torch.float32), ("tiny-llama", torch.bfloat16), ("tiny-bloom", torch.float32)])
def test_a_meta_skeleton_materialised_on_the_device_equals_the_ordinary_build(model, dtype):
    """Strategy.build_on_device + materialise_on_device, run on the CPU as a GPU run runs them: the same tensors as
    the ordinary build of the same seed, the tied head tied again."""
    from shardlab.strategies.ddp import DDPStrategy
    from shardlab.training.models import build_model

    cfg = RunConfig(model=model, device="cpu")
    built = _strategy(DDPStrategy, cfg, "cpu").materialise_on_device(build_model(cfg, dtype=dtype, meta=True))
    ref = build_model(cfg, dtype=dtype)
    assert list(built.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), ref.state_dict().values()))
    out, inp = built.get_output_embeddings(), built.get_input_embeddings()
    assert (out.weight is inp.weight) == (ref.get_output_embeddings().weight is ref.get_input_embeddings().weight)


def test_gpu_runs_build_on_meta_unless_samples_need_the_model_before_training():
    from shardlab.strategies.ddp import DDPStrategy
    from shardlab.strategies.pipeline import PipelineStrategy

    cfg = RunConfig(model="tiny-gpt2")
    assert all(p.is_meta for p in _strategy(DDPStrategy, cfg, "cuda").build_model().parameters())
    assert not any(p.is_meta for p in _strategy(DDPStrategy, cfg.model_copy(update={"samples": True}), "cuda").build_model().parameters())
    assert not any(p.is_meta for p in _strategy(DDPStrategy, cfg, "cpu").build_model().parameters())
    assert not any(p.is_meta for p in _strategy(PipelineStrategy, cfg, "cuda").build_model().parameters())
