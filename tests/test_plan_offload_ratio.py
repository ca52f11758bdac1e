"""zero3_offload's partial offload (`--offload-ratio`, DeepSpeed's Twin-Flow) in the plan (issue 14): which optimizer
sub-groups DeepSpeed 0.19.8 keeps on the GPU, and the GPU and host bytes that moves. Expectations are worked out by
hand from GPT-2's parameter list, not from the planner's formulas."""

from __future__ import annotations

import pytest

from shardlab.config import RunConfig
from shardlab.planning.planner import plan
from shardlab.planning.strategy_plan import predict_cpu_run
from shardlab.strategies.memory.deepspeed_zero import twin_flow_gpu_sub_groups, zero3_sub_groups

S = "zero3_offload"


def test_sub_groups_are_cut_as_deepspeed_cuts_them():
    # a sub-group closes at the first parameter that takes it to >= sub_group_size, or at its group's end
    assert zero3_sub_groups([[60, 60, 60, 60], [1, 1]], 100) == [120, 120, 2]
    assert zero3_sub_groups([[150, 10, 30]], 100) == [150, 40]
    assert zero3_sub_groups([[50, 50], [7]], 100) == [100, 7]  # a group no larger than the size stays whole


@pytest.mark.parametrize("count, ratio, on_gpu", [
    (10, 0.7, 3), (11, 0.5, 5), (2, 0.5, 1), (2, 0.3, 1), (2, 0.7, 0),
    (10, 0.9, 0),  # (1 - 0.9) * 10 is 0.999..., and DeepSpeed takes int() of it
    (1, 0.5, 0), (10, 1.0, 0),
])
def test_twin_flow_keeps_the_first_sub_groups_rounded_down(count, ratio, on_gpu):
    assert twin_flow_gpu_sub_groups(count, ratio) == on_gpu


# GPT-2 (124,439,808 parameters, hidden 768; no weight decay: one parameter group in model order). sub_group_size =
# max(1e8, n / 10) = 1e8. wte 38,597,376 + wpe 786,432 = 39,383,808; a block is 7,087,872 (c_attn 1,769,472 + 2,304,
# attn c_proj 589,824 + 768, c_fc 2,359,296 + 3,072, mlp c_proj 2,359,296 + 768, two LayerNorms 4 x 768). After 8
# blocks 96,086,784; block 9's ln_1, c_attn, c_proj, ln_2 and c_fc weight take it to 100,811,520 >= 1e8: the first
# sub-group. The rest, 23,628,288, is the second.
G0, G1 = 100_811_520, 23_628_288
N = 124_439_808


def _zero3_offload(ratio: float, pin: bool = True):
    cfg = RunConfig(model="gpt2", seq_len=256, micro_batch=1, precision="bf16", gpus=1, strategy=S,
                    strategy_options={"offload_ratio": ratio, "pin_memory": pin})
    return plan(cfg, gpu_memory_gb=80, strategies=(S,)).strategies[S]


def test_ratio_one_keeps_every_sub_group_on_the_host():
    sp = _zero3_offload(1.0)
    assert G0 + G1 == N
    assert sp.gpu["gradients"] == sp.gpu["optimizer"] == sp.gpu["step buffers"] == 0
    # one pinned fp32 gradient buffer per sub-group, each rounded up to a power of two: 403 MB -> 2^29, 95 MB -> 2^27
    assert sp.cpu_detail["fp32 gradient buffer per sub-group"] == 2**29 + 2**27
    assert sp.cpu_detail["fp32 master partition"] == 4 * N
    assert sp.cpu_detail["AdamW m, v (CPU Adam)"] == 8 * N
    assert not any("GPU sub-group" in k for k in sp.cpu_detail)


def test_ratio_half_keeps_the_first_sub_group_on_the_gpu():
    full, half = _zero3_offload(1.0), _zero3_offload(0.5)  # int((1 - 0.5) * 2) = 1 sub-group on the GPU
    # GPU: its fp32 master + torch AdamW m, v (12 B), its fp32 gradient buffer (4 B, kept from start to end)
    assert half.gpu["optimizer"] == 12 * G0 and half.gpu["gradients"] == 4 * G0
    assert half.gpu["step buffers"] == 4 * G0  # torch's foreach AdamW: sqrt(v) of that sub-group
    assert half.peak_moment == full.peak_moment
    assert half.gpu_peak - full.gpu_peak == 16 * G0
    # host: master and m, v of the second sub-group only; the first one's pinned staging buffer (2^29) stays cached
    # (no host sub-group has its size); the step copies its update into the 16-bit params via a 4 B/elem temporary
    assert half.cpu_detail["fp32 master partition"] == 4 * G1
    assert half.cpu_detail["AdamW m, v (CPU Adam)"] == 8 * G1
    assert half.cpu_detail["fp32 gradient buffer per sub-group"] == 2**27
    assert half.cpu_detail["pinned gradient staging of GPU sub-groups, kept cached"] == 2**29
    assert half.cpu_detail["fp32 host staging of a GPU sub-group's update (optimizer step)"] == 4 * G0
    for same in ("16-bit gradient partition flat buffer", "16-bit param partition (flat, always pinned)"):
        assert half.cpu_detail[same] == full.cpu_detail[same]
    assert full.cpu_per_node - half.cpu_per_node == 8 * G0  # 12 B moved to the GPU, 4 B of step staging back
    assert half.model_state_bytes_per_param == pytest.approx(16 * G0 / N)
    assert "1 of 2 optimizer sub-groups" in half.notes[0]


def test_unpinned_ratio_keeps_no_staging_block():
    sp = _zero3_offload(0.5, pin=False)
    assert "pinned gradient staging of GPU sub-groups, kept cached" not in sp.cpu_detail
    assert sp.cpu_detail["fp32 gradient buffer per sub-group"] == 4 * G1


def test_ratio_that_rounds_to_no_sub_group_changes_nothing():
    full, most = _zero3_offload(1.0), _zero3_offload(0.7)  # int(0.3 * 2) = 0 on the GPU
    assert (most.gpu_peak, most.cpu_per_node) == (full.gpu_peak, full.cpu_per_node)


def test_cpu_run_is_host_memory_whatever_the_ratio():
    """On a CPU-only machine DeepSpeed's accelerator is the CPU: the 'GPU' sub-groups are host tensors stepped by CPU
    Adam, so the run's memory is the same at any ratio."""
    def cpu(ratio):
        cfg = RunConfig(model="gpt2", strategy=S, device="cpu", seq_len=64, micro_batch=2, grad_accum=1,
                        strategy_options={"offload_ratio": ratio})
        sp, total = predict_cpu_run(cfg, 1, reuse_heap=True)
        return sp.gpu_peak, sp.cpu_detail, total

    assert cpu(0.5) == cpu(1.0)
