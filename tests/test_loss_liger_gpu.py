"""loss_kernel=liger with Liger-Kernel's real Triton kernel: skipped without a CUDA GPU and liger_kernel (CI has neither;
benchmarks/gpu_liger.sh runs it on the H100 before it measures).

Tolerances are those of the arithmetic, not of a machine: fp32 matmuls with TF32 off agree with the reference to
~1e-5 relative; bf16 operands to ~1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardlab.config import RunConfig
from shardlab.runtime.distributed import DistEnv
from shardlab.strategies import strategy_class
from shardlab.training import loss
from shardlab.training.models import build_model
from shardlab.runtime.resolved import Precision

try:
    import liger_kernel  # noqa: F401

    HAVE_LIGER = True
except ImportError:
    HAVE_LIGER = False

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_LIGER), reason="needs a CUDA GPU and liger_kernel")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_the_reference(dtype, tol):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    n, h, v = 3000, 256, 5000  # several of liger's chunks, a vocabulary that is no power of two
    hidden = torch.randn(n, h, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", dtype=dtype) * h ** -0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda")
    targets[::7] = loss.IGNORE
    fused = loss.fused_linear_cross_entropy()
    got = fused(hidden, weight, targets)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    # reference in fp64 on the same (rounded) inputs
    ref = loss.reference_linear_cross_entropy(hidden.double(), weight.double(), targets)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    assert torch.isfinite(got) and abs(got.item() - ref.item()) / ref.item() < tol
    for g, r in zip(got_grads, ref_grads):
        assert g.dtype == dtype and _rel(g, r) < tol


def _dp(model, kernel: str, precision: str):
    cfg = RunConfig(model="tiny-gpt2", device="cuda", precision=precision, loss_kernel=kernel, lr=1e-3, warmup_steps=0,
                    max_grad_norm=None)
    strategy = strategy_class("dp")(cfg, DistEnv(0, 1, 0, torch.device("cuda", 0), "nccl"), Precision(precision), 1, 4)
    strategy.setup(model, total_steps=10)
    return strategy


@pytest.mark.parametrize("precision, against, tol", [("fp32", "hf", 1e-4), ("bf16", "compiled", 2e-2)])
def test_dp_trains_as_the_other_kernels(precision, against, tol):
    """tiny-gpt2 (tied head) on the GPU: per-step losses and the tied weight's gradient as the model's own loss (fp32)
    or shardlab's compiled loss (bf16 autocast); eval too."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    base = build_model(RunConfig(model="tiny-gpt2", device="cpu")).eval()
    ref, fused = _dp(copy.deepcopy(base), against, precision), _dp(copy.deepcopy(base), "liger", precision)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, base.config.vocab_size, (4, 64), generator=g).cuda()
    labels = ids.clone()
    labels[0, :9] = loss.IGNORE
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    for step in range(4):
        want, got = ref.forward(batch), fused.forward(batch)
        assert abs(got.item() - want.item()) / want.item() < tol, (step, got.item(), want.item())
        ref.backward(want, True)
        fused.backward(got, True)
        wte = "transformer.wte.weight"
        grads = dict(ref.hf_model.named_parameters())
        assert _rel(dict(fused.hf_model.named_parameters())[wte].grad, grads[wte].grad) < 10 * tol
        ref.optimizer_step()
        fused.optimizer_step()
    with torch.no_grad():
        assert abs(fused.forward(batch).item() - ref.forward(batch).item()) / ref.forward(batch).item() < tol
