"""`dp`: torch DistributedDataParallel; on a world of one, the bare model with no wrapper.

Every rank holds full parameters, gradients and optimizer states; gradients are
all-reduced in buckets during backward. Mixed precision is torch autocast over fp32
master weights (plus a GradScaler for fp16), the standard PyTorch recipe.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..training import compiling
from .torch_optim import TorchOptimizerStrategy


class DDPStrategy(TorchOptimizerStrategy):
    plain_tensor_params = True

    def build_model(self) -> nn.Module:
        """fp32 (autocast's master weights), or bf16 with ``--master-weights bf16`` (on the CPU, a bf16 build; on a
        GPU, see ``build_on_device``: a 13B model never passes through host memory)."""
        from ..training import optim

        return self.build_on_device(self.base_dtype(torch.bfloat16 if optim.bf16_master(self.cfg) else torch.float32))

    def setup(self, model: nn.Module, total_steps: int) -> None:
        self.hf_model = self.materialise_on_device(model).to(self.env.device)
        wrapped: nn.Module = self.hf_model
        whole_graph = self.cfg.compile and not compiling.compile_blocks(self.hf_model, self.cfg)
        if self.env.is_distributed:
            device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
            # Gradients as views into DDP's all-reduce buckets: no second copy of every gradient beside the buckets.
            # zero_grad(set_to_none=True) drops the views; backward then makes each gradient afresh, DDP copies it into
            # its bucket and points .grad back at the bucket, so only one parameter's fresh gradient exists at a time.
            wrapped = DistributedDataParallel(wrapped, device_ids=device_ids, gradient_as_bucket_view=True)
        if whole_graph:  # outside DDP, so its bucketed all-reduce hooks stay eager
            wrapped = compiling.compile_module(wrapped, self.cfg)
        self.model = wrapped
        self._build_optimizer(self.hf_model, self.env.device.type, total_steps)

    def accumulate(self, last_micro: bool):
        ddp = getattr(self.model, "_orig_mod", self.model)
        if isinstance(ddp, DistributedDataParallel) and not last_micro:
            return ddp.no_sync()  # skip the all-reduce until the accumulation window closes
        return contextlib.nullcontext()

    def full_state_dict(self, trainable_only: bool = False):
        if not self.env.is_main:
            return None
        if trainable_only:
            return {k: p.detach().cpu() for k, p in self.hf_model.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu() for k, v in self.hf_model.state_dict().items()}

    def memory_note(self) -> str:
        if self.base_dtype(torch.float32) != torch.float32:
            return (f"frozen {self.precision.name} base weights, fp32 adapters with their gradients and AdamW states on every "
                    "GPU (2 B/base param + 16 B/adapter param + activations)")
        if self.cfg.master_weights == "bf16":
            return "bf16 parameters and gradients, 8-bit AdamW states on every GPU (2 + 2 + 2 B/param + activations)"
        return "full fp32 parameters, gradients and AdamW states on every GPU (16 B/param + activations)"
