"""The adapter plan (planning/adapters.py) against the runs measured on one H200 (seq 1024, bf16, dp, r 8, all-linear):
what is within 5% and what is not, and why.

    run                                   measured   planned   within 5%?
    llama-2-7b qlora micro 1, steady      4.39       ~4.38     yes (frozen NF4 base + fp32 rest + adapter states)
    llama-2-70b qlora micro 1, steady     36.11      ~36.39    yes
    llama-2-7b qlora micro 1, peak        12.77      ~13.89    no: +9%; the adapters' autocast input casts are counted
                                                               one per adapted layer, an upper bound not yet traced
    llama-2-70b qlora micro 1, peak       81.66      ~85.73    yes, at the edge (+5.0%), for the same reason
    llama-2-7b lora micro 8, fp32 base    88.18      ~112.1    no: +27% (fp32-residual activations, weight copies and
                                                               the adapters' input casts all counted: an upper bound)
    llama-2-7b lora micro 8, bf16 base    65.37      ~59.6     no: -9%, and 65.37 is HF's peer, not shardlab's run
"""

from __future__ import annotations

import pytest

from shardlab.config import RunConfig
from shardlab.planning import adapters as adapter_memory
from shardlab.planning.planner import plan

GiB = 2**30


def _dp(model: str, method: str, micro: int):
    cfg = RunConfig(model=model, seq_len=1024, micro_batch=micro, precision="bf16", peft={"method": method}, gpus=1)
    return plan(cfg, gpu_memory_gb=139, strategies=("dp",)).strategies["dp"]


def _steady(sp) -> float:
    return (sp.gpu["parameters"] + sp.gpu["optimizer"]) / GiB


@pytest.mark.parametrize("model,measured,tolerance", [("llama-2-7b", 4.39, 0.05), ("llama-2-70b", 36.11, 0.05)])
def test_qlora_steady_state_within_5_percent(model, measured, tolerance):
    assert _steady(_dp(model, "qlora", 1)) == pytest.approx(measured, rel=tolerance)


@pytest.mark.parametrize("model,measured,tolerance", [("llama-2-70b", 81.66, 0.055), ("llama-2-7b", 12.77, 0.10)])
def test_qlora_peak(model, measured, tolerance):
    # 70B within ~5%; 7B is +9% (the adapters' own autocast casts of their fp32 inputs, counted as new tensors)
    assert _dp(model, "qlora", 1).gpu_peak / GiB == pytest.approx(measured, rel=tolerance)


def test_lora_peaks(monkeypatch):
    bf16_base = _dp("llama-2-7b", "lora", 8).gpu_peak / GiB
    monkeypatch.setattr(adapter_memory, "LORA_BASE_IN_COMPUTE_DTYPE", False)
    fp32_base = _dp("llama-2-7b", "lora", 8).gpu_peak / GiB
    print(f"lora micro 8: bf16 base {bf16_base:.2f} planned vs 65.37 (HF peer); fp32 base {fp32_base:.2f} vs 88.18")
    # Neither within 5%: the bf16-base plan (~59.6) is 9% under HF's bf16-base peer (a different program: its own
    # autocast and loss); the fp32-base plan (~112.1) is 27% over the measured 88.18: it counts autocast's fp32 residual
    # activations, every frozen weight's 16-bit copy and one 16-bit cast of each adapted layer's input, which the run
    # evidently does not all keep. Both gaps pinned here so that a change to either shows.
    assert bf16_base == pytest.approx(65.37, rel=0.10)
    assert 1.20 < fp32_base / 88.18 < 1.30


def test_only_qlora_fits_70b_on_one_h200_with_512_gib_of_host_ram():
    cfg = RunConfig(model="llama-2-70b", seq_len=1024, micro_batch=1, precision="bf16", gpus=1)
    p = plan(cfg, gpu_memory_gb=139, host_ram_gb=512)  # the offloads need 0.7-1.8 TiB of host RAM
    assert p.adapters["qlora (dp)"].fits and not p.adapters["lora (dp)"].fits
    assert "only an adapter fits: qlora (dp)" in p.reason
