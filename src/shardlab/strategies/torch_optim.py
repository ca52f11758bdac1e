"""What the PyTorch-native strategies (dp, fsdp, pipeline) share: torch's AdamW, the lr schedule,
GradScaler for fp16, the clip-then-step sequence, and one checkpoint format.

dp, fsdp and pipeline write torch.distributed.checkpoint (DCP) directories keyed by the HF model's
parameter names: every rank writes its own shards or stages (replicated tensors once), and DCP reshards
on load, so a checkpoint of any of them resumes under the others and on another number of ranks or
pipeline stages without conversion."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compat import fused_clip
from ..training import optim
from ..errors import UserError
from .base import Strategy

# Lazy imports below: torch.distributed.checkpoint loads only when a checkpoint is saved or loaded.

CKPT_DIR = "torch_dcp"
EXTRA_FILE = "torch_extra.pt"  # scheduler and GradScaler: plain state dicts, identical on every rank


def check_checkpointable(cfg) -> None:
    if cfg.optimizer_in_backward or cfg.optimizer == "adamw8bit":
        # DCP's optimizer-state helpers know torch optimizers over the model's parameters: not one optimizer
        # per parameter (in backward), nor torchao's quantised state tensors.
        raise UserError(f"checkpoints are not supported with {optim.arithmetic(cfg)} yet",
                        "drop --save-every/--save-each-epoch/--resume, or train with --optimizer adamw")


class TorchOptimizerStrategy(Strategy):
    # Plain (non-DTensor) parameters: clipping can ride in the fused AdamW kernel (compat/fused_clip.py).
    plain_tensor_params = False

    @classmethod
    def check_options(cls, run) -> None:
        super().check_options(run)
        cfg = run.cfg
        if cfg.save_every or cfg.save_each_epoch or cfg.resume:
            check_checkpointable(cfg)

    def _build_optimizer(self, module: nn.Module, device_type: str, total_steps: int, cpu_fused: bool = False) -> None:
        self.optimizer = optim.build(module, self.cfg, device_type, cpu_fused)
        self.scheduler = optim.scheduler(self.optimizer, self.cfg, total_steps)
        # Dynamic loss scaling is what keeps fp16 gradients from underflowing.
        self.scaler = torch.amp.GradScaler(self.env.device.type, enabled=self.precision.name == "fp16")
        fused = bool(self.optimizer.defaults.get("fused"))
        self._fold_clip = self.plain_tensor_params and fused and not self.scaler.is_enabled() and fused_clip.available()

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        self.scaler.scale(loss).backward()  # weighted by train_step (tokens over the step's, across ranks) already

    def optimizer_step(self) -> float | None:
        norm = None
        if self.cfg.optimizer_in_backward:  # every parameter stepped in backward (no norm: nothing to clip)
            self.optimizer.step()
            self.scheduler.step()
            return None
        params = list(self.hf_model.parameters())
        if self.cfg.max_grad_norm is not None and self._fold_clip:
            norm_t = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            norm = float(norm_t)
            self.last_step_skipped = not math.isfinite(norm)
            if not self.last_step_skipped:  # the clip rides in the fused AdamW kernel
                fused_clip.fused_clipped_step(self.optimizer, norm_t, self.cfg.max_grad_norm)
        else:
            if self.cfg.max_grad_norm is not None:  # no clipping: skip the norm's extra pass over all grads
                self.scaler.unscale_(self.optimizer)
                norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
            elif self.cfg.nan_policy == "skip" and not self.scaler.is_enabled():  # skipping needs the norm first
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the mesh
                norm = norm.full_tensor()
            norm = None if norm is None else float(norm)
            if self.scaler.is_enabled():
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)  # skips the update itself on inf/nan gradients
                self.scaler.update()
                self.last_step_skipped = self.scaler.get_scale() < scale
                if self.last_step_skipped:
                    self.overflow_steps += 1
            else:
                self.last_step_skipped = norm is not None and not math.isfinite(norm)
                if not self.last_step_skipped:  # non-finite gradients never reach the weights
                    self.optimizer.step()
        if not self.last_step_skipped:
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])  # torchao's optimizers keep lr as a tensor

    # ---- checkpoints (dp, fsdp; the pipeline maps its stages' names to the model's, strategies/pipeline.py) ----
    def _dcp_state(self) -> dict[str, Any]:
        check_checkpointable(self.cfg)  # again here: a preemption signal can ask for a checkpoint too
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.hf_model, self.optimizer, options=self._state_options())
        if self.cfg.peft.method:  # torch drops frozen parameters by their first name only: a tied head stayed
            trainable = {n for n, p in self.hf_model.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trainable}
        return {"model": model_sd, "optimizer": optim_sd}

    def _state_options(self):
        """With --peft a checkpoint holds the adapters and their optimizer states only: the frozen base is rebuilt from
        its source on resume (the layout records the seed and settings that rebuild it), so it is not written again,
        and a 4-bit base, which DCP cannot store, never reaches it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        adapted = self.cfg.peft.method is not None
        return StateDictOptions(ignore_frozen_params=adapted, strict=not adapted)

    def save_checkpoint(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=str(directory / CKPT_DIR))
        if self.env.is_main:
            torch.save({"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}, directory / EXTRA_FILE)

    def _dcp_load(self, path: Path) -> None:
        """Model and optimizer state from the DCP directory `path` into this rank's modules."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.hf_model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=self._state_options())

    def load_checkpoint(self, directory: Path) -> None:
        if not (directory / CKPT_DIR).is_dir():
            raise UserError(f"{str(directory)!r} has no {CKPT_DIR}/ (a checkpoint of another strategy, or of a shardlab before dp, fsdp and pipeline shared one format)",
                            "resume it with the strategy and shardlab version that wrote it")  # fmt: skip
        self._dcp_load(directory / CKPT_DIR)
        extra = torch.load(directory / EXTRA_FILE, map_location="cpu", weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])

    def load_full_state(self, full) -> None:
        """Resume from a consolidated state (reshard.FullState): full tensors keyed by parameter name.

        Every rank passes the full tensors; torch's set_state_dict keeps each rank's shard (FSDP).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        params = dict(self.hf_model.named_parameters(remove_duplicate=False))
        aliases: dict[int, list[str]] = {}
        for name, p in params.items():  # tied weights (GPT-2's lm_head is wte): one tensor, several names
            aliases.setdefault(id(p), []).append(name)
        model_sd = {}
        for name, value in self.hf_model.state_dict().items():
            source = next((a for a in [name, *aliases.get(id(params.get(name)), [])] if a in full.model), None)
            if source is None:
                raise UserError(f"the checkpoint lacks the weight {name!r} of this model", "resume with the model the checkpoint was written with")
            # (ZeRO-3 universal checkpoints keep flat tensors: the model gives the shapes back)
            model_sd[name] = full.model[source].reshape(value.shape).to(value.dtype)
        names = {id(p): n for n, p in self.hf_model.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]} for g in self.optimizer.param_groups]
        state = {}
        for group in groups:
            for name in group["params"]:
                moments = full.optim.get(name)
                if moments is not None:
                    shape = params[name].shape
                    state[name] = {"step": torch.tensor(float(full.step)), **{k: v.reshape(shape).float() for k, v in moments.items()}}
        set_state_dict(self.hf_model, self.optimizer, model_state_dict=model_sd, optim_state_dict={"state": state, "param_groups": groups},
                       options=StateDictOptions(full_state_dict=True))  # fmt: skip
        if full.scheduler is not None:
            self.scheduler.load_state_dict(full.scheduler)
