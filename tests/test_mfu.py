"""MFU: FLOPs per token (PaLM appendix B: 6N + 12 L H Q T) and the dense-peak table, checked by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardlab import mfu
from shardlab.config import RunConfig
from shardlab.models import build_hf_config


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
