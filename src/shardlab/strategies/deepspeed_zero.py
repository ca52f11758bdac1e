"""`zero0`..`zero3`, `*_offload`, `infinity`: DeepSpeed ZeRO engines built from the RunConfig.

The DeepSpeed JSON the engine gets is generated from the run (deepspeed_config.py), a user's own JSON merged on top
(deepspeed_json.py); what the machine must offer first (NVMe room, the ops DeepSpeed compiles) is deepspeed_machine.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import messages
from ..training import optim
from ..config import RunConfig
from ..errors import UserError
from .base import Strategy
from ..specs.registry import spec
from ..compat.zero3_release_cache import apply_release_cache_fix
from ..compat import zero3_norm, zero3_one_rank
from .deepspeed_config import STAGE, compile_problem, offload_kind, one_rank_shortcuts, resolved_ds_config, zero3_leaf_classes
from .deepspeed_machine import announce_op_builds, check_nvme_path, sanitize_cuda_arch_list

# Lazy imports below: deepspeed (seconds to import, logs on import) and transformers load only when an engine is built
# or a DeepSpeed checkpoint read.

CKPT_TAG = "deepspeed"


def model_numel(model: nn.Module) -> int:
    """The model's parameter count, also once ZeRO-3 has partitioned it (zero.Init leaves each ``p.data`` empty and
    records the full size in ``p.ds_numel``): what sizes the buckets (deepspeed_config.sized_buckets)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# ---- the strategy -------------------------------------------------------------------------------------


class DeepSpeedStrategy(Strategy):
    reads_deepspeed_config = True

    @classmethod
    def cpu_optimizer(cls, cfg: RunConfig) -> bool:
        return offload_kind(cfg.strategy) is not None

    @classmethod
    def check_options(cls, run) -> None:
        super().check_options(run)  # offload_ratio and zenflow on the wrong strategy: there
        cfg, world, device_type = run.cfg, run.world, run.device_type
        opts, s = cfg.strategy_options, run.spec
        if opts.zenflow and device_type != "cuda":
            raise UserError("--zenflow needs a CUDA GPU (its important-column step runs there)", "drop --zenflow on CPU")
        if problem := compile_problem(cfg, device_type):
            raise problem
        if cfg.nan_policy == "skip" and s.zero_stage == 0:
            raise UserError("--nan-policy skip is not supported with zero0 (DeepSpeed applies its stage-0 updates unchecked)", "use --nan-policy stop, or zero1 / dp")
        if cfg.deepspeed_config and cfg.micro_batch != "auto":  # its mistakes now, not once per rank after the spawn
            from .deepspeed_schema import check_with_deepspeed

            ds = resolved_ds_config(cfg, run.precision.name, run.micro, run.accum, world, device_type)
            check_with_deepspeed(ds, Path(cfg.deepspeed_config).name)  # every key DeepSpeed would refuse in each rank
        if s.offload_params == "nvme":  # NVMe path missing, not writable or too small: before any run dir exists
            from transformers import AutoModelForCausalLM

            from ..training.models import build_hf_config

            with torch.device("meta"):
                n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(build_hf_config(cfg)).parameters())
            check_nvme_path(opts.nvme_path, n_params, opts.nvme_min_free_gb)

    def transfer_bytes_per_param(self) -> tuple[float, float]:
        # 16-bit gradients go to the host's fp32 partition after every micro-batch; ZeRO-1/2 copy the updated
        # 16-bit weights back once per step, ZeRO-3 fetches them for every forward and again for backward.
        lo = 4.0 if self.precision.name == "fp32" else 2.0
        if STAGE[self.cfg.strategy] == 3:
            return 2 * lo * self.grad_accum, lo * self.grad_accum
        if (getattr(self, "ds_json", None) or {}).get("data_types", {}).get("grad_accum_dtype") == "fp32" and lo == 2.0:
            return lo, 4.0  # offload_grad_accum_fp32: the fp32 sum leaves the GPU once, at the boundary
        # each micro-batch's gradient goes out; all but the first micro-batch's running sum comes back first
        return lo * self.grad_accum, lo * self.grad_accum

    def ds_config(self, total_steps: int | None = None, n_params: int | None = None, hidden: int | None = None,
                  leaf_classes: list[str] | None = None) -> dict[str, Any]:
        """What DeepSpeed gets, both for the engine and for the ZeRO-3 build's zero.Init (a user's JSON merged in)."""
        return resolved_ds_config(self.cfg, self.precision.name, self.micro_batch, self.grad_accum, self.env.world_size,
                                  self.env.device.type, total_steps, n_params, hidden, leaf_classes)

    def build_model(self) -> nn.Module:
        """Built in the engine's own dtype: with bf16/fp16 every stage keeps 16-bit module weights (the engine
        casts the module with ``.bfloat16()``/``.half()``) and makes its fp32 master from them, so an fp32
        build is only a transient twice the size. ZeRO-3 builds inside ``deepspeed.zero.Init`` (transformers
        does so while an ``HfDeepSpeedConfig`` is alive, and loads checkpoints into the partitions), so no
        rank ever holds the whole model; with parameter offload the partitions are created on the CPU."""
        from ..training.models import build_model

        dtype = self.precision.dtype
        if STAGE[self.cfg.strategy] < 3:
            return self.build_on_device(dtype)  # the engine moves it to the GPU anyway: draw it there
        sanitize_cuda_arch_list()
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        # zero.Init checks the batch triple against deepspeed.comm's world size, which is 1 until DeepSpeed has
        # adopted the torch.distributed group that is already up (deepspeed.initialize does it only later).
        deepspeed.init_distributed(dist_backend=self.env.backend)
        live = HfDeepSpeedConfig(self.ds_config())  # transformers holds a weak reference: only while `live` exists
        try:
            return build_model(self.cfg, dtype=dtype)
        finally:
            del live  # later transformers calls (export, generate) must not think ZeRO-3 is still being set up

    def setup(self, model: nn.Module, total_steps: int) -> None:
        sanitize_cuda_arch_list()
        import deepspeed

        model = self.materialise_on_device(model)

        hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "n_embd", None)
        n_params = model_numel(model)  # ZeRO-3's partitioned p.numel() is 0: its sub_group_size stayed at 1e9
        ds = self.ds_config(total_steps, n_params, hidden, zero3_leaf_classes(model))  # (NVMe path: launch.preflight)
        self.hf_model = model
        kwargs: dict[str, Any] = {"model": model, "config": ds}
        if "optimizer" in ds:
            kwargs["model_parameters"] = optim.param_groups(model, self.cfg.weight_decay)
        else:  # only on a CPU without offload (use_deepspeed_optimizer): torch's AdamW, as dp uses it
            kwargs["optimizer"] = optim.adamw(model, self.cfg, self.env.device.type)
        if "scheduler" not in ds:
            lr_fn = optim.lr_lambda(self.cfg, total_steps)
            kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_fn)
        self.ds_json = ds

        def log(message: str) -> None:
            if self.env.is_main:
                messages.info(message)

        if self.env.is_main:
            announce_op_builds(ds, log)
        if STAGE[self.cfg.strategy] == 3:  # DeepSpeed keeps the first trace's release decisions otherwise (the eval's)
            apply_release_cache_fix(log)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(**kwargs)
        self.model = self.engine
        shortcuts = one_rank_shortcuts(self.cfg.strategy_options, STAGE[self.cfg.strategy], self.env.world_size,
                                       spec(self.cfg.strategy).offloads)
        self.one_rank_shortcuts: list[str] = zero3_one_rank.apply(self.engine, shortcuts, log) if shortcuts else []
        if STAGE[self.cfg.strategy] == 3 and self.cfg.strategy_options.zero3_foreach_norm and not spec(self.cfg.strategy).offload_optimizer:
            zero3_norm.apply(self.engine, log)  # an offloaded optimizer takes its norm on the host path: DeepSpeed's
        if self.cfg.compile:  # DeepSpeed's own compile: torch.compile of the engine's module, its hooks left in place
            from ..training import compiling

            if not compiling.compile_blocks(self.engine.module, self.cfg):
                self.engine.compile(backend=compiling.backend(), compile_kwargs=compiling.options(self.cfg))

    def summary_extras(self) -> dict[str, Any]:
        out = super().summary_extras()
        # the engine's ZeRO section as it ran (sized buckets, persistence, overlap, offload, one-rank ZeRO-3's leaf_module
        # classes and contiguous_gradients): the record of what shardlab or the user's JSON chose, so a run shows it and a
        # comparison can check it (a worker once lost the sizing without a trace)
        out["zero_optimization"] = (getattr(self, "ds_json", None) or {}).get("zero_optimization", {})
        if getattr(self, "one_rank_shortcuts", None):
            out["zero3_one_rank_shortcuts"] = list(self.one_rank_shortcuts)
            out["zero3_steps_kept_gathered"] = getattr(self.engine.optimizer, "shardlab_kept_gathered", None)
        return out

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        # weighted by train_step (tokens over the step's, across ranks) already: the engine's own 1/accum would count
        # micro-batches, not tokens (transformers' Trainer turns it off the same way)
        self.engine.backward(loss, scale_wrt_gas=False)
        if not last_micro:
            self.engine.step()  # advances DeepSpeed's micro-step counter; no optimizer step yet

    def optimizer_step(self) -> float | None:
        grad_norm = None
        if STAGE[self.cfg.strategy] == 0 and not self.precision.is_mixed:
            # Stage 0 in fp32 leaves grads in place and reports no norm; compute it as DDP does.
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None
        skipped_before = self.engine.skipped_steps
        self.engine.step()  # ZeRO-1/2/3 skip the update themselves when a gradient is inf/nan (any precision)
        self.last_step_skipped = self.engine.skipped_steps > skipped_before
        if self.last_step_skipped:
            self.skipped_steps += 1
            self.overflow_steps += self.precision.name == "fp16"
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            grad_norm = float(norm)
        return grad_norm

    def current_lr(self) -> float:
        return self.engine.get_lr()[0]

    def save_checkpoint(self, directory: Path) -> None:
        # --peft: the adapters and their optimizer partitions only (the frozen base is rebuilt on resume)
        self.engine.save_checkpoint(str(directory), tag=CKPT_TAG, save_latest=False,
                                    exclude_frozen_parameters=self.cfg.peft.method is not None)

    def load_checkpoint(self, directory: Path, tag: str = CKPT_TAG, universal: bool = False) -> None:
        """`universal`: `directory/tag` is a DeepSpeed universal checkpoint (any stage, any world size)."""
        self.engine._config.load_universal_checkpoint = universal  # read at load time only; no engine rebuild needed
        try:
            path, _ = self.engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True,
                                                  load_module_strict=self.cfg.peft.method is None)
        finally:
            self.engine._config.load_universal_checkpoint = False
        if path is None:
            raise UserError(f"no DeepSpeed checkpoint in {str(directory)!r}", "resume from a checkpoint written by a DeepSpeed strategy")
        if universal:
            # ZeRO-3's universal load gives every parameter group the *same* step tensor; torch's AdamW
            # increments it in place, once per group, so bias correction would run ahead. One each.
            base = getattr(self.engine.optimizer, "optimizer", None)
            for state in getattr(base, "state", {}).values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()

    _evaluated = False  # an eval forward ran since training last did

    def eval(self) -> None:
        super().eval()
        self._evaluated = True

    def train(self) -> None:
        super().train()
        if self._evaluated and STAGE[self.cfg.strategy] == 3 and getattr(self, "engine", None) is not None:
            # An eval forward replays the training trace, so it ends with what backward would use first still gathered
            # (the tied embedding, the last blocks) or in flight; backward does not come, and the next training
            # micro-batch gathered its own on top: bloom-3b zero3_offload on one H100 peaked at 13.28 GiB in the step
            # after an epoch-end eval, 11.41 + the 1.87 the eval kept (benchmarks/results/*-h100-big-model call 8; 11.41 with this, call 9). DeepSpeed's
            # own call for the end of an eval/inference pass releases them (as full_state_dict does below).
            self.engine.empty_partition_cache()
        self._evaluated = False

    def full_state_dict(self, trainable_only: bool = False):
        module = self.engine.module
        if STAGE[self.cfg.strategy] < 3:
            if not self.env.is_main:
                return None
            if trainable_only:
                return {k: p.detach().cpu().clone() for k, p in module.named_parameters() if p.requires_grad}
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        import deepspeed

        # An eval forward ends with the next step's parameters prefetched (in flight); gathering one of them would
        # trip DeepSpeed's "Cannot partition a param in flight". This waits for them and releases every parameter.
        self.engine.empty_partition_cache()
        out: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            # One parameter at a time keeps the gather's peak at the largest tensor, not the whole model.
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if self.env.is_main:
                    out[name] = param.detach().cpu().clone()
        if not self.env.is_main:
            return None
        for name, buf in module.named_buffers() if not trainable_only else ():
            out.setdefault(name, buf.detach().cpu().clone())
        return out

    def memory_note(self) -> str:
        stage = STAGE[self.cfg.strategy]
        where = {None: self.env.device.type.upper(), "cpu": "CPU", "nvme": "NVMe"}[offload_kind(self.cfg.strategy)]
        sharded = {0: "nothing sharded", 1: "optimizer states sharded", 2: "optimizer states and gradients sharded", 3: "parameters, gradients and optimizer states sharded"}[stage]
        return f"ZeRO-{stage}: {sharded} across ranks; optimizer states on {where}"
