"""The adapter plan (planning/adapters.py) against the runs measured on one H200 (seq 1024, bf16, dp, r 8, all-linear;
benchmarks/results/2026-11-28-h200-adapters/, call 3):

    run                                          measured GiB   planned   within 5%?
    llama-2-7b lora micro 8 (bf16 base)          63.41          ~63.56    yes
    llama-2-7b lora micro 8 --compile            48.39          ~50.19    yes (+3.7%)
    llama-2-7b qlora micro 1, steady             3.90           ~3.89     yes (NF4 base, the rest in bf16, adapter states)
    llama-2-7b qlora micro 1, peak               9.27           ~9.19     yes
    llama-2-7b qlora micro 1, checkpointing      4.44           ~4.37     yes
    llama-2-70b qlora micro 1, steady            35.15          ~35.41    yes
    llama-2-70b qlora micro 1, peak              63.70          ~63.43    yes
    llama-2-7b lora micro 8, fp32 base (call 1)  88.18          ~112.1    no: +27%, the fp32 base shardlab no longer keeps
"""

from __future__ import annotations

import pytest
import torch

from shardlab.config import RunConfig
from shardlab.planning import adapters as adapter_memory
from shardlab.planning.planner import plan

GiB = 2**30


def _dp(model: str, method: str, micro: int, **kw):
    cfg = RunConfig(model=model, seq_len=1024, micro_batch=micro, precision="bf16", peft={"method": method}, gpus=1, **kw)
    return plan(cfg, gpu_memory_gb=139, strategies=("dp",)).strategies["dp"]


def _steady(sp) -> float:
    return (sp.gpu["parameters"] + sp.gpu["optimizer"]) / GiB


@pytest.mark.parametrize("model,measured", [("llama-2-7b", 3.90), ("llama-2-70b", 35.15)])
def test_qlora_steady_state_within_5_percent(model, measured):
    assert _steady(_dp(model, "qlora", 1)) == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("model,micro,ckpt,measured", [("llama-2-7b", 1, False, 9.27), ("llama-2-7b", 1, True, 4.44),
                                                       ("llama-2-70b", 1, False, 63.70)])
def test_qlora_peak_within_5_percent(model, micro, ckpt, measured):
    assert _dp(model, "qlora", micro, gradient_checkpointing=ckpt).gpu_peak / GiB == pytest.approx(measured, rel=0.05)


def test_lora_peaks(monkeypatch):
    assert _dp("llama-2-7b", "lora", 8).gpu_peak / GiB == pytest.approx(63.41, rel=0.05)
    assert _dp("llama-2-7b", "lora", 8, compile=True).gpu_peak / GiB == pytest.approx(48.39, rel=0.05)
    monkeypatch.setattr(adapter_memory, "LORA_BASE_IN_COMPUTE_DTYPE", False)
    fp32_base = _dp("llama-2-7b", "lora", 8).gpu_peak / GiB
    # The fp32 base (call 1) is not within 5%: the plan counts autocast's fp32 residual activations, every frozen
    # weight's 16-bit copy and one 16-bit cast of each adapted layer's input, which that run did not all keep. Pinned
    # so that a change to it shows.
    assert 1.20 < fp32_base / 88.18 < 1.30


def test_only_qlora_fits_70b_on_one_h200_with_512_gib_of_host_ram():
    cfg = RunConfig(model="llama-2-70b", seq_len=1024, micro_batch=1, precision="bf16", gpus=1)
    p = plan(cfg, gpu_memory_gb=139, host_ram_gb=512)  # the offloads need 0.7-1.8 TiB of host RAM
    assert p.adapters["qlora (dp)"].fits and not p.adapters["lora (dp)"].fits
    assert "only an adapter fits: qlora (dp)" in p.reason


@pytest.mark.parametrize("adapters_fp32", [True, False], ids=["fp32-adapters-autocast", "16-bit-adapters"])
def test_a_frozen_16_bit_base_saves_what_the_plan_counts(adapters_fp32):
    """Traced on CPU (saved-tensor hooks, a 4-layer minus a 2-layer Llama: one layer's bytes): a bf16 base with LoRA
    on every linear layer against the same base fully trained in bf16. With fp32 adapters under autocast (dp's LoRA),
    peft casts each layer's 16-bit input to fp32 and autocast casts it back: a copy per adapted layer, where full
    fine-tuning keeps one per distinct input; the frozen RMSNorms keep no normalised values for their weights. With
    adapters in the base's dtype (no cast: bitsandbytes' 4-bit layer under autocast behaves so) only the norms' saving
    remains. llama-2-7b LoRA micro 8 on one H200 measured 63.41 GiB against 63.56 planned with this, 59.56 without."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardlab.planning.adapters import activations, count_adapters
    from shardlab.planning.memory import Activations
    from shardlab.planning.arch import arch_from_hf_config

    from test_plan import _saved_tensors

    transformers.logging.set_verbosity_error()
    h, ffn, micro, seq, r = 256, 688, 2, 64, 8

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(num_hidden_layers=layers, hidden_size=h, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=ffn, vocab_size=1000, bos_token_id=0, eos_token_id=0)

    def saved(layers: int, lora: bool) -> int:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(layers), dtype=torch.bfloat16, attn_implementation="sdpa")
        if not lora:
            return sum(n for n, _, _ in _saved_tensors(model, micro, seq).values())
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
        shapes = set()
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32 if adapters_fp32 else torch.bfloat16)  # peft's default: fp32
                shapes |= {tuple(p.shape), tuple(p.shape)[::-1]}
        # autocast's 16-bit copies of the adapter weights are weights, not activations
        return sum(n for n, _, shape in _saved_tensors(model, micro, seq, autocast=adapters_fp32).values()
                   if shape not in shapes)

    full = (saved(4, False) - saved(2, False)) / 2
    adapted = (saved(4, True) - saved(2, True)) / 2
    arch = arch_from_hf_config(config(2), attn_impl="sdpa")
    ad = count_adapters(arch, "lora", r, "all-linear")
    none = Activations(layers=0.0, embed_final=0.0, logits_saved=0.0, logits_peak=0.0, recompute=0.0, per_layer=0.0,
                       logits_grad=0.0)
    planned = activations(none, arch, ad, "lp", micro, seq, 0.0, False, autocast=adapters_fp32).per_layer
    print(f"per layer: full {full:.0f} B, adapted {adapted:.0f} B, traced difference {adapted - full:.0f}, planned {planned:.0f}")
    assert adapted - full == pytest.approx(planned, rel=0.05)
