"""Gradient clipping inside torch's fused AdamW kernel, through the hook GradScaler uses.

Clipping multiplies every gradient by ``max_norm / norm``: a full read and write of all gradients, ~1 ms per step for
gpt2-medium on an H100. torch's fused AdamW kernel already reads every gradient, and divides it by
``optimizer.grad_scale`` when that attribute is set (torch/optim/adam.py and adamw.py read it for fused optimizers; it
is how GradScaler unscales for free). Setting it to the reciprocal of the clip coefficient for one step clips for free.
Only for fused AdamW without a GradScaler (bf16/fp32), and a finite norm; outside the torch versions it was tested on
the strategies clip with ``clip_grad_norm_`` before the step, torch's own way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import applied, enabled


def available() -> bool:
    """Whether a strategy may fold its clip into the fused step (else it clips the gradients itself)."""
    return enabled("fused_clip")


@contextlib.contextmanager
def gradients_divided_by(optimizers: list[torch.optim.Optimizer], scale: torch.Tensor) -> Iterator[None]:
    """While inside, each fused optimizer's step divides its gradients by ``scale`` (on that optimizer's device)."""
    for opt in optimizers:
        opt.grad_scale = scale.to(opt.param_groups[0]["params"][0].device)
    applied("fused_clip")
    try:
        yield
    finally:
        for opt in optimizers:
            del opt.grad_scale


def fused_clipped_step(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """`optimizer.step()` on gradients clipped to `max_norm`, without a separate pass over them."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    with gradients_divided_by([optimizer], coef.reciprocal().float()):
        optimizer.step()
