"""`dp`: torch DistributedDataParallel; on a world of one, the bare model with no wrapper.

Every rank holds full parameters, gradients and optimizer states; gradients are
all-reduced in buckets during backward. Mixed precision is torch autocast over fp32
master weights (plus a GradScaler for fp16), the standard PyTorch recipe.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import optim
from .base import Strategy

STATE_FILE = "dp_state.pt"


class DDPStrategy(Strategy):
    name = "dp"

    def setup(self, model: nn.Module, total_steps: int) -> None:
        self.hf_model = model.to(self.env.device)
        wrapped: nn.Module = self.hf_model
        if self.env.is_distributed:
            device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
            wrapped = DistributedDataParallel(wrapped, device_ids=device_ids)
        if self.cfg.compile:
            wrapped = torch.compile(wrapped)
        self.model = wrapped
        self.optimizer = optim.adamw(self.hf_model, self.cfg, self.env.device.type)
        self.scheduler = optim.scheduler(self.optimizer, self.cfg, total_steps)
        # Dynamic loss scaling is what keeps fp16 gradients from underflowing.
        self.scaler = torch.amp.GradScaler(self.env.device.type, enabled=self.precision.name == "fp16")

    def accumulate(self, last_micro: bool):
        ddp = getattr(self.model, "_orig_mod", self.model)
        if isinstance(ddp, DistributedDataParallel) and not last_micro:
            return ddp.no_sync()  # skip the all-reduce until the accumulation window closes
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        self.scaler.scale(loss / self.grad_accum).backward()

    def optimizer_step(self) -> float | None:
        norm = None
        if self.cfg.max_grad_norm is not None:  # no clipping: skip the norm's extra pass over all grads
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.hf_model.parameters(), self.cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if norm is None else float(norm)

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save_checkpoint(self, directory: Path) -> None:
        if self.env.is_main:
            state = {
                "model": self.hf_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
            }
            torch.save(state, directory / STATE_FILE)

    def load_checkpoint(self, directory: Path) -> None:
        state = torch.load(directory / STATE_FILE, map_location=self.env.device, weights_only=True)
        self.hf_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])

    def full_state_dict(self):
        if not self.env.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self.hf_model.state_dict().items()}

    def memory_note(self) -> str:
        return "full fp32 parameters, gradients and AdamW states on every GPU (16 B/param + activations)"
