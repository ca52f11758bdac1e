"""MFU: FLOPs per token (PaLM appendix B: 6N + 12 L H Q T) and the dense-peak table, checked by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from shardlab.measure import mfu
from shardlab.config import RunConfig
from shardlab.training.models import build_hf_config


def meta_model(name: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(build_hf_config(RunConfig(model=name)))


def test_gpt2_medium_on_h100_matches_the_hand_computed_mfu():
    # gpt2-medium: 354,823,168 parameters, of which the position table (wpe, 1024 x 1024) is a look-up and the token
    # table is tied to the LM head (a real matmul): N = 354,823,168 - 1,048,576 = 353,774,592.
    model = meta_model("gpt2-medium")
    assert sum(p.numel() for p in model.parameters()) == 354_823_168
    flops = mfu.model_flops(model, seq_len=1024)
    assert flops["matmul_params"] == 353_774_592
    # 6N = 2,122,647,552; attention 12 x 24 layers x 1024 (16 heads x 64) x 1024 tokens = 301,989,888
    assert flops["flops_per_token"] == 2_122_647_552 + 301_989_888 == 2_424_637_440
    # The H100 foundation run: 57,195 useful tok/s in bf16 on one "NVIDIA H100 80GB HBM3" (dense bf16 peak 989.4 TFLOP/s):
    # 57,195 x 2,424,637,440 = 1.38677e14 FLOP/s -> / 9.894e14 = 0.14016
    got = mfu.mfu(57_195, flops["flops_per_token"], "NVIDIA H100 80GB HBM3", "bf16", n_devices=1)
    assert got == pytest.approx(57_195 * 2_424_637_440 / 989.4e12, rel=1e-12)
    assert got == pytest.approx(0.14016, abs=5e-5)
    # two GPUs at the same total rate: half the utilisation
    assert mfu.mfu(57_195, flops["flops_per_token"], "NVIDIA H100 80GB HBM3", "bf16", n_devices=2) == pytest.approx(got / 2)


def test_bloom_has_no_position_table_and_a_tied_head():
    model = meta_model("tiny-bloom")  # ALiBi: no position embeddings; word embeddings tied to lm_head
    n = sum(p.numel() for p in model.parameters())
    assert mfu.matmul_params(model) == n
    layers, width = mfu.attention_width(model.config)
    assert (layers, width) == (2, 64)
    assert mfu.model_flops(model, 64)["flops_per_token"] == 6 * n + 12 * 2 * 64 * 64


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-40GB", "fp16", 312.0),
        ("NVIDIA A100 80GB PCIe", "bf16", 312.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
        ("Tesla V100-PCIE-16GB", "fp16", 112.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("NVIDIA H100 80GB HBM3", "fp32", 66.9),  # no TF32: CUDA cores
    ],
)
def test_known_dense_peaks(name, precision, peak):
    assert mfu.peak_tflops(name, precision) == peak


def test_tf32_uses_the_tensor_core_peak():
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32_enabled=True) == 156.0
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32_enabled=False) == 19.5


@pytest.mark.parametrize("name", [None, "", "cpu", "NVIDIA A10G", "NVIDIA GH200 480GB", "NVIDIA H100 NVL", "NVIDIA L40",
                                  "NVIDIA GeForce RTX 4090 D", "AMD Instinct MI300X", "Some Future GPU"])
def test_unknown_devices_get_no_mfu(name):
    assert mfu.find_peak(name) is None
    assert mfu.mfu(50_000, 2_424_637_440, name, "bf16", 1) is None


def test_a_precision_the_gpu_lacks_gets_no_mfu():
    assert mfu.peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None  # Volta has no bf16 tensor cores


def test_summary_fields_on_cpu_say_why_mfu_is_missing():
    summary = {"precision": "fp32", "device_type": "cpu", "world_size": 1, "useful_tokens_per_s": 1000.0, "tokens_per_s": 1000.0}
    out = mfu.summary_fields(summary, {"flops_per_token": 21_472_128}, None)
    assert out["mfu"] is None and out["peak_tflops_per_device"] is None
    assert "no dense peak" in out["mfu_note"]
    assert out["model_tflops_per_s"] == pytest.approx(1000.0 * 21_472_128 / 1e12)


def test_summary_fields_on_a_known_gpu():
    summary = {"precision": "bf16", "device_type": "cuda", "world_size": 1, "useful_tokens_per_s": 57_195.0, "tokens_per_s": 57_195.0}
    out = mfu.summary_fields(summary, {"flops_per_token": 2_424_637_440}, "NVIDIA H100 80GB HBM3")
    assert out["peak_tflops_per_device"] == 989.4 and out["peak_math_mode"] == "bf16"
    assert out["mfu"] == pytest.approx(0.14016, abs=5e-5)
    assert "mfu_note" not in out


def counted_training_flops(name: str, batch: int, seq_len: int):
    """torch's FlopCounterMode over one forward + backward of a preset (meta tensors: shapes only, nothing computed).

    Eager attention: its Q K^T and softmax . V are plain (b)bmm calls the counter sees; the fused CPU SDPA kernel
    Llama picks by default is not in the counter's table and would count as zero.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_hf_config(RunConfig(model=name)), attn_implementation="eager")
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        mask = torch.ones_like(ids)  # without one, transformers' padding check calls .item(), which meta tensors lack
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return model, by_op


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bloom", "tiny-llama", "qwen2.5-0.5b"])
def test_flop_counter_agrees_with_the_formula(name):
    """The oracle: torch counts 2 FLOPs per multiply-add of every matmul, forward and backward.

    Term by term, exactly: the weight matmuls (mm/addmm) are 6 x (weights of Linear/Conv1D layers, the tied LM head
    included) per token, and attention (bmm; BLOOM's ALiBi scores are a baddbmm) is 12 L (H Q) T per token. The
    formula's N also holds the biases and the norm gains, as PaLM's "6N" counts every non-embedding parameter: the
    counter sees none of their work (a bias add is not a matmul), so the whole-step totals differ by exactly
    6 x those parameters per token (under 0.1% for these models, by design, not a bug). qwen2.5 adds q/k/v biases
    and grouped K/V heads to the tiny presets' cases.
    """
    batch, seq_len = 2, 16
    tokens = batch * seq_len
    model, by_op = counted_training_flops(name, batch, seq_len)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Conv1D)))
    layers, width = mfu.attention_width(model.config)
    assert by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0) == 6 * weights * tokens
    assert by_op.get("aten.bmm", 0) + by_op.get("aten.baddbmm", 0) == 12 * layers * width * seq_len * tokens
    assert set(by_op) <= {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}  # nothing else the formula would miss

    flops = mfu.model_flops(model, seq_len)
    not_matmul = flops["matmul_params"] - weights  # biases and norm gains
    assert 0 < not_matmul < 0.002 * flops["matmul_params"]
    assert flops["flops_per_token"] * tokens == sum(by_op.values()) + 6 * not_matmul * tokens


def test_a_frozen_base_counts_4_flops_per_weight_and_its_adapters_6():
    """--peft lora: the frozen base gets no weight gradients, so the oracle counts 4 FLOPs per base weight and token
    (forward, input gradient) and 6 per adapter weight; ``model_flops`` says so in ``flops_counted``. Exact but for the
    first block's q/k/v projections (base and lora_A), whose input (a frozen embedding, normed by a frozen gain) needs
    no gradient: autograd skips their input gradient, under 1/L of the base's share, which the formula keeps."""
    import peft

    batch, seq_len = 2, 16
    tokens = batch * seq_len
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(build_hf_config(RunConfig(model="tiny-llama")), attn_implementation="eager")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        mask = torch.ones_like(ids)
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}

    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    frozen = sum(m.weight.numel() for m in linear if not m.weight.requires_grad)
    trainable = sum(m.weight.numel() for m in linear if m.weight.requires_grad)
    first = model.get_base_model().model.layers[0].self_attn
    no_input_grad = sum(getattr(first, n).base_layer.weight.numel() + getattr(first, n).lora_A["default"].weight.numel()
                        for n in ("q_proj", "k_proj", "v_proj"))
    assert trainable and by_op["aten.mm"] == (4 * frozen + 6 * trainable - 2 * no_input_grad) * tokens

    flops = mfu.model_flops(model, seq_len)
    layers, width = mfu.attention_width(model.config)
    assert flops["flops_counted"] == mfu.ADAPTER_COUNT == "4 x frozen + 6 x trainable params per token + attention"
    assert flops["trainable_matmul_params"] == trainable
    norms = flops["matmul_params"] - frozen - trainable  # the frozen norm gains, which no matmul uses
    assert flops["flops_per_token"] == 4 * (frozen + norms) + 6 * trainable + 12 * layers * width * seq_len
    assert mfu.model_flops(meta_model("tiny-llama"), seq_len)["flops_counted"] == mfu.FULL_COUNT  # every weight trained
    out = mfu.summary_fields({"precision": "bf16", "device_type": "cpu"}, flops, None)
    assert out["flops_counted"] == mfu.ADAPTER_COUNT and out["flops_formula"].startswith("4N_frozen + 6N_trainable")
