"""The output head's matmul on a padded vocabulary (training/head_padding.py): the same logits and gradients, nothing
else changed (parameter shapes, tied embedding, state dict), on where it is wanted only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.config import RunConfig
from shardlab.training import head_padding


def _gpt2(vocab=97):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64)).eval()


@pytest.mark.parametrize("autocast", [False, True])
def test_padded_head_gives_the_same_logits_loss_and_gradients(autocast):
    plain, padded = _gpt2(), _gpt2()
    line = head_padding.apply(padded, RunConfig(pad_head=True), "cpu", "hf")
    assert line and "97 -> 128" in line
    assert type(padded.lm_head).__name__ == "VocabPaddedLinear" and isinstance(padded.lm_head, nn.Linear)
    assert padded.lm_head.weight is padded.transformer.wte.weight  # still tied, same parameter
    assert padded.state_dict().keys() == plain.state_dict().keys()
    assert padded.lm_head.weight.shape == (97, 32)
    ids = torch.randint(0, 97, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out_plain, out_padded = plain(input_ids=ids, labels=ids), padded(input_ids=ids, labels=ids)
    assert out_padded.logits.shape == out_plain.logits.shape == (2, 16, 97)
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out_padded.logits, out_plain.logits, **tol)
    out_plain.loss.backward()
    out_padded.loss.backward()
    assert out_padded.loss.item() == pytest.approx(out_plain.loss.item(), rel=1e-2 if autocast else 1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, **tol, msg=name)


def test_only_where_it_pays():
    head = nn.Linear(8, 50257, bias=False)
    assert head_padding.wanted(RunConfig(), "cuda", "compiled", head)  # auto: on a GPU, for an unaligned vocabulary
    assert not head_padding.wanted(RunConfig(), "cpu", "hf", head)  # auto: not on the CPU
    assert not head_padding.wanted(RunConfig(pad_head=False), "cuda", "compiled", head)
    assert not head_padding.wanted(RunConfig(), "cuda", "liger", head)  # liger has no head matmul of its own
    assert not head_padding.wanted(RunConfig(), "cuda", "compiled", nn.Linear(8, 50304, bias=False))  # aligned already
    assert not head_padding.wanted(RunConfig(pad_head=True), "cuda", "compiled", nn.Identity())


@pytest.mark.slow
def test_a_padded_head_trains_like_the_plain_one(tmp_path, train_cli):
    """tiny-gpt2 (50,257 tokens), 10 fp32 steps on the offline corpus, pad_head on and off: the same losses (1e-5)."""
    args = ["--model", "tiny-gpt2", "--max-steps", "10", "--seq-len", "32", "--micro-batch", "2", "--lr", "1e-3",
            "--dropout", "0", "--precision", "fp32", "--log-every", "1", "--no-export", "--set", "dataset.eval_samples=1"]
    on = train_cli([*args, "--set", "pad_head=true"], tmp_path / "on").check()
    off = train_cli(args, tmp_path / "off").check()
    assert "padded 50,257 -> 50,304" in on.stdout and "padded" not in off.stdout
    assert on.losses == pytest.approx(off.losses, rel=1e-5)


def test_the_plan_counts_the_padded_head_weight_where_it_is_one_more_copy():
    """Over the engine's own 16-bit weights (DeepSpeed, FSDP2) the padded copy of GPT-2's head is one more tensor saved
    for backward (gpt2 zero2_offload seq 512 on an H100: 0.072 GiB at the peak, 2026-11-27-h100-plan-validation); under
    dp's autocast it replaces autocast's copy; none without padding (pad_head=false, liger, an aligned vocabulary)."""
    from shardlab.planning.planner import plan

    cfg = RunConfig(model="gpt2", seq_len=512, micro_batch=2, precision="bf16", gpus=1)
    on = plan(cfg, gpu_memory_gb=80, strategies=("zero2_offload", "dp"))
    off = plan(cfg.model_copy(update={"pad_head": False}), gpu_memory_gb=80, strategies=("zero2_offload", "dp"))
    extra = 2 * 50304 * 768  # bf16, GPT-2's 50,257 rows padded to 50,304
    assert on.strategies["zero2_offload"].gpu_peak - off.strategies["zero2_offload"].gpu_peak == pytest.approx(extra)
    assert on.strategies["dp"].gpu_peak == off.strategies["dp"].gpu_peak
    liger = plan(cfg.model_copy(update={"loss_kernel": "liger"}), gpu_memory_gb=80, strategies=("zero2_offload",))
    liger_off = plan(cfg.model_copy(update={"loss_kernel": "liger", "pad_head": False}), gpu_memory_gb=80, strategies=("zero2_offload",))
    assert liger.strategies["zero2_offload"].gpu_peak == liger_off.strategies["zero2_offload"].gpu_peak
    bloom = RunConfig(model="bloom-560m", seq_len=512, micro_batch=2, precision="bf16", gpus=1)  # 250,880 = 64 x 3,920
    assert (plan(bloom, gpu_memory_gb=80, strategies=("zero2_offload",)).strategies["zero2_offload"].gpu_peak
            == plan(bloom.model_copy(update={"pad_head": False}), gpu_memory_gb=80, strategies=("zero2_offload",))
            .strategies["zero2_offload"].gpu_peak)
