"""Precision choice, optimizer parameter groups and the learning-rate schedule.

Shared by every strategy so that a strategy changes memory, not the mathematics:
the same decay/no-decay split, the same AdamW hyper-parameters, the same schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import RunConfig
from .errors import UserError


@dataclass(frozen=True)
class Precision:
    name: str  # "bf16" | "fp16" | "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.name]

    @property
    def is_mixed(self) -> bool:
        return self.name != "fp32"


def resolve_precision(requested: str, device_type: str, bf16_supported: bool | None = None) -> Precision:
    """'auto' is bf16 on GPUs that have it, else fp16 on older GPUs, and fp32 on CPU.

    CPU defaults to fp32 because CPU bf16 matmuls are slow on most machines and
    fp16 autocast is not a CPU training mode.
    """
    if device_type == "cuda" and bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    if requested == "auto":
        if device_type == "cuda":
            return Precision("bf16" if bf16_supported else "fp16")
        return Precision("fp32")
    if requested == "bf16" and device_type == "cuda" and not bf16_supported:
        raise UserError(
            "bf16 requested but this GPU does not support bfloat16 (it needs compute capability 8.0+, e.g. A100/H100)",
            "use --precision fp16 (dynamic loss scaling) or --precision fp32",
        )
    if requested == "fp16" and device_type == "cpu":
        raise UserError("fp16 training is not supported on CPU", "use --precision fp32 or bf16 on CPU")
    return Precision(requested)


NO_DECAY_HINTS = ("bias", "norm", "ln_", "ln_f")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases, norms (and other 1-D tensors) are not decayed, as in GPT-2/nanoGPT.

    Without weight decay the split changes nothing, so every parameter goes into one group: fused
    AdamW (and DeepSpeed's flat buffers) then run once per step instead of once per group, as in a
    bare `AdamW(model.parameters())` loop. A checkpoint's layout records the weight decay
    (reshard.layout), so a resume cannot switch between one group and two silently.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if weight_decay == 0:
        return [{"params": trainable, "weight_decay": 0.0}]
    decay, no_decay = [], []
    for p in trainable:
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw(model: nn.Module, cfg: RunConfig, device_type: str) -> torch.optim.Optimizer:
    # fused AdamW is the fastest torch kernel on CUDA; on CPU torch picks its single-tensor path (foreach is for accelerators).
    fused = device_type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused,
    )


def fused_clipped_step(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """`optimizer.step()` on gradients clipped to `max_norm`, without a separate pass over them.

    Clipping multiplies every gradient by `max_norm / norm` (a full read+write of all gradients,
    ~1 ms per step for gpt2-medium on an H100). The fused AdamW kernel already reads every
    gradient and divides it by `optimizer.grad_scale` when that is set (the hook GradScaler uses
    for fused optimizers), so setting it to the reciprocal of the clip coefficient clips for free.
    Only for fused AdamW without a GradScaler (bf16/fp32), and a finite `total_norm`.
    """
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    optimizer.grad_scale = coef.reciprocal().float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def lr_lambda(cfg: RunConfig, total_steps: int):
    """Multiplier of the peak lr at optimizer step `step`: linear warmup, then cosine/linear/constant."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if cfg.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
