"""What the PyTorch-native strategies (dp, fsdp, pipeline) share: torch's AdamW, the lr schedule,
GradScaler for fp16, and the clip-then-step sequence. DeepSpeed brings its own equivalents."""

from __future__ import annotations

import torch
from torch import nn

from .. import optim
from .base import Strategy


class TorchOptimizerStrategy(Strategy):
    # Plain (non-DTensor) parameters: clipping can ride in the fused AdamW kernel (optim.clip_and_step_fused).
    plain_tensor_params = False

    def _build_optimizer(self, module: nn.Module, device_type: str, total_steps: int) -> None:
        self.optimizer = optim.adamw(module, self.cfg, device_type)
        self.scheduler = optim.scheduler(self.optimizer, self.cfg, total_steps)
        # Dynamic loss scaling is what keeps fp16 gradients from underflowing.
        self.scaler = torch.amp.GradScaler(self.env.device.type, enabled=self.precision.name == "fp16")
        fused = bool(self.optimizer.defaults.get("fused"))
        self._fold_clip = self.plain_tensor_params and fused and not self.scaler.is_enabled()

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        self.scaler.scale(loss / self.grad_accum).backward()

    def optimizer_step(self) -> float | None:
        norm = None
        if self.cfg.max_grad_norm is not None and self._fold_clip:
            norm = optim.clip_and_step_fused(self.optimizer, self.hf_model.parameters(), self.cfg.max_grad_norm)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        if self.cfg.max_grad_norm is not None:  # no clipping: skip the norm's extra pass over all grads
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.hf_model.parameters(), self.cfg.max_grad_norm)
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the mesh
                norm = norm.full_tensor()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if norm is None else float(norm)

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]
