"""The optimizer helpers shared by the PyTorch-native strategies."""

import copy

import pytest
import torch
from torch import nn

from shardlab.compat.fused_clip import fused_clipped_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping active / inactive
def test_clip_folded_into_fused_adamw_equals_clip_then_step(max_norm):
    ref, folded = _model(), None
    folded = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt_fold = torch.optim.AdamW(folded.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * 10
        for m in (ref, folded):
            m(x).pow(2).mean().backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt_ref.step()
        norm_fold = torch.nn.utils.get_total_norm([p.grad for p in folded.parameters()])
        fused_clipped_step(opt_fold, norm_fold, max_norm)
        assert torch.allclose(norm_ref, norm_fold, rtol=1e-6)
        for opt in (opt_ref, opt_fold):
            opt.zero_grad(set_to_none=True)
        assert not hasattr(opt_fold, "grad_scale")  # the hook is removed after the step
    for p_ref, p_fold in zip(ref.parameters(), folded.parameters()):
        torch.testing.assert_close(p_ref, p_fold, rtol=1e-5, atol=1e-6)
    if max_norm < 1:
        assert float(norm_ref) > max_norm  # the clipped case really clipped
