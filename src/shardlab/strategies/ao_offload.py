"""`ao_offload`: torchao's CPUOffloadOptimizer on one GPU.

Parameters (fp32 master weights, as dp keeps them) and the forward/backward stay on the GPU; each
gradient is copied to pinned host memory on a side stream as soon as backward produces it, the
AdamW step runs on the CPU (torch's fused CPU AdamW) and the updated weights go back on the side
stream, so transfers overlap backward. Exact fp32 AdamW; 16 B/param of host RAM (fp32 weight,
gradient, m, v), 4 B/param of GPU weights (+ gradients until their copy finishes when accumulating).

torchao does the offload on CUDA (or XPU) only, and for a single process (no gradient all-reduce
sits between the gradient hook and the copy): both are refused in one line before the run.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..compat import fused_clip
from ..training import compiling, optim
from ..errors import UserError
from .ddp import DDPStrategy


class AOOffloadStrategy(DDPStrategy):

    @classmethod
    def cpu_optimizer(cls, cfg) -> bool:
        return True

    @classmethod
    def check_options(cls, run) -> None:
        super().check_options(run)
        cfg, world = run.cfg, run.world
        optim.torchao_optim()
        if run.device_type != "cuda":
            raise UserError("strategy 'ao_offload' needs a CUDA GPU (torchao's CPUOffloadOptimizer offloads from CUDA/XPU only)",
                            "run it on a GPU, or use fsdp_offload / zero2_offload on CPU")
        if world > 1:
            raise UserError(f"strategy 'ao_offload' runs on one GPU (got {world} processes): torchao copies each gradient out "
                            "before any all-reduce", "pass --gpus 1, or use zero2_offload / fsdp_offload on several GPUs")
        if cfg.save_every or cfg.save_each_epoch or cfg.resume:
            raise UserError("checkpoints are not supported with strategy 'ao_offload' yet",
                            "drop --save-every/--save-each-epoch/--resume, or use zero2_offload")
        if cfg.precision == "fp16":
            raise UserError("strategy 'ao_offload' does not support fp16 loss scaling", "use --precision bf16")

    def setup(self, model: nn.Module, total_steps: int) -> None:
        self.hf_model = self.materialise_on_device(model).to(self.env.device)
        # Per block by default: the whole-model graph would hand torchao every gradient at the end of backward.
        self.model = compiling.compile_model(self.hf_model, self.cfg)
        cfg = self.cfg
        groups = optim.param_groups(self.hf_model, cfg.weight_decay)
        # With one micro-batch per step the device gradient is freed once its copy is done; accumulating needs it.
        self._free_grads = self.grad_accum == 1
        # The global norm, summed on the GPU in a hook that runs before torchao's (hooks run in registration
        # order), so clipping needs no pass over the freed device gradients nor the host copies.
        self._sq_norm = torch.zeros((), device=self.env.device, dtype=torch.float32)
        if self._free_grads and cfg.max_grad_norm is not None:
            for group in groups:
                for p in group["params"]:
                    p.register_post_accumulate_grad_hook(self._add_sq_norm)
        self.optimizer = optim.torchao_optim().CPUOffloadOptimizer(
            groups, torch.optim.AdamW, offload_gradients=self._free_grads, fused=True,
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        self.scheduler = optim.scheduler(self.optimizer, cfg, total_steps)
        self.scaler = torch.amp.GradScaler(self.env.device.type, enabled=False)

    def transfer_bytes_per_param(self) -> tuple[float, float]:
        # fp32 weights back once; fp32 gradients out once: during backward with one micro-batch a step, at step()
        # when accumulating (offload_gradients is off then, so the sum stays on the GPU until the step)
        return 4.0, 4.0

    def _add_sq_norm(self, p: torch.Tensor) -> None:
        self._sq_norm += p.grad.detach().float().pow(2).sum()

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        opt = self.optimizer
        return [*opt.optim_dict.values(), *([opt.d_opt] if opt.d_opt is not None else [])]

    def optimizer_step(self) -> float | None:
        cfg, norm = self.cfg, None
        if cfg.max_grad_norm is not None or cfg.nan_policy == "skip":
            if self._free_grads and cfg.max_grad_norm is not None:
                norm_t = self._sq_norm.sqrt()
            else:
                norm_t = torch.nn.utils.get_total_norm([p.grad for p in self.hf_model.parameters() if p.grad is not None])
            norm = float(norm_t)
        self.last_step_skipped = norm is not None and not math.isfinite(norm)
        if self.last_step_skipped:
            self.optimizer.stream.synchronize()  # copies in flight land before the host gradients are reused
            self.optimizer.queue.clear()
            self.skipped_steps += 1
        else:
            clip = contextlib.nullcontext()
            if cfg.max_grad_norm is not None and fused_clip.available():
                # Clip inside the fused AdamW kernels (compat/fused_clip.py), on each optimizer's device: the CPU ones
                # for the offloaded tensors, the GPU one for the small tensors torchao keeps there.
                coef = torch.clamp(cfg.max_grad_norm / (norm_t + 1e-6), max=1.0).reciprocal().float()
                clip = fused_clip.gradients_divided_by(self._inner_optimizers(), coef)
            elif cfg.max_grad_norm is not None:  # torch's own clip, once every gradient's copy to the host has landed
                for copied in self.optimizer.queue.values():
                    copied.synchronize()
                params = [p for inner in self._inner_optimizers() for g in inner.param_groups for p in g["params"]]
                torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, norm_t)
            with clip:
                self.optimizer.step()
            self.scheduler.step()
        self._sq_norm.zero_()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save_checkpoint(self, directory):  # a preemption signal can still ask for one
        raise UserError("checkpoints are not supported with strategy 'ao_offload' yet",
                        "drop --save-every/--save-each-epoch/--resume, or use zero2_offload")

    load_checkpoint = save_checkpoint

    def memory_note(self) -> str:
        return ("torchao CPUOffloadOptimizer: fp32 parameters on the GPU; gradients copied to pinned host memory during backward, "
                "exact AdamW states and step on the CPU (16 B/param host), weights copied back overlapped")
