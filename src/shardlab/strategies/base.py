"""The small interface every strategy implements; the training loop calls only these verbs.

A strategy owns the wrapped model, the optimizer, the lr scheduler and (for fp16) the loss
scaler. The loss of a step weighs tokens, as transformers' Trainer does: the summed token losses
of all its micro-batches on all data-parallel ranks over the step's count of label tokens.
``train_step`` hands ``backward`` each micro-batch's share of it, already weighted; engines that
would scale it again (DeepSpeed by 1/gradient_accumulation_steps) are told not to.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import messages
from ..training import attention_backend, loss, optim, sdpa_causal
from ..config import RunConfig
from ..errors import UserError
from ..runtime.distributed import DistEnv, bind_threads_to_rank_cores
from ..layout import data_parallel_size, local_world_size
from ..runtime.resolved import Precision, ResolvedRun
from ..specs.registry import StrategySpec, spec
from ..measure.timesplit import StepSplit

# Lazy imports below: transformers (training.models) loads with the model, not with the strategy class (preflight and
# the dry run and autobatch ask strategy classes about the layout).


def _as(value: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """`value` in `like`'s dtype when it is a tensor (a float64 count's quotient would promote the loss); a number stays
    a number (multiplying by it copies nothing to the device)."""
    return value.to(like.dtype) if isinstance(value, torch.Tensor) else value


def summed(count: int, device: torch.device, group=None) -> torch.Tensor:
    """`count` summed over the ranks of `group` (default: all), as a float64 device tensor (exact up to 2**53)."""
    total = torch.tensor(float(count), dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return total


class Strategy(ABC):
    # The capability flags (supports_compile, uses_autocast, own_loss, eval_whole_steps, supports_8bit,
    # supports_in_backward) are the run's StrategySpec's (specs/): one class serves several names.
    # Optimizer steps not applied: non-finite gradients, or fp16 loss-scale overflows (counted apart too).
    skipped_steps: int = 0
    overflow_steps: int = 0
    last_step_skipped: bool = False

    def __init__(self, cfg: RunConfig, env: DistEnv, precision: Precision, grad_accum: int, micro_batch: int):
        self.spec: StrategySpec = spec(cfg.strategy)
        self.name = self.spec.name
        self.cfg = cfg
        self.env = env
        self.precision = precision
        self.grad_accum = grad_accum
        self.micro_batch = micro_batch
        self.model: nn.Module | None = None  # what the loop calls forward on
        # None: the HF model computes its own loss from `labels`; else a fused loss on its logits.
        self.loss_fn = None if self.spec.own_loss else loss.build(cfg.loss_kernel, env.device.type)
        self.loss_kernel = "hf" if self.loss_fn is None else loss.resolve_loss_kernel(cfg.loss_kernel, env.device.type)
        self.hf_model: nn.Module | None = None  # the unwrapped transformers model (config, save_pretrained)
        self.bound_cores: list[int] = []
        # Ranks that compute on the CPU (a CPU optimizer, or a CPU device) get their own share of the cores: with torch's
        # default of one thread per core in every rank, N ranks run N x cores threads that spin against each other
        # (2 ranks on 2 cores: 0.82 s a step for tiny-gpt2 instead of 0.23 s). torchrun sets OMP_NUM_THREADS=1 for this.
        local_world = local_world_size()
        if (self.cpu_optimizer(cfg) or (env.device.type == "cpu" and local_world > 1)) and cfg.strategy_options.bind_cores:
            self.bound_cores = bind_threads_to_rank_cores(env.local_rank, local_world)

        self.time_split = StepSplit(env.device, self.cpu_optimizer(cfg))

    # ---- building -----------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The model ``setup`` receives. Default: the whole model in fp32 (what dp keeps: autocast over fp32
        weights), on the GPU when it can be (``build_on_device``); engines that keep less override it."""
        return self.build_on_device(self.base_dtype(torch.float32))

    def base_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the model is built in where an engine would keep ``dtype`` master weights: with ``--peft lora`` under a
        16-bit precision the compute dtype, as a frozen weight gets no update that an fp32 master would keep (7B: 13 GB
        less than fp32); peft then keeps the adapters, the only trained weights, in fp32 (autocast_adapter_dtype)."""
        if self.cfg.peft.method == "lora" and self.precision.is_mixed:
            return self.precision.dtype
        return dtype

    def build_on_device(self, dtype: torch.dtype) -> nn.Module:
        """The whole model in ``dtype``. On a GPU, for a preset or a local checkpoint whose names match
        (``meta_loadable``), the skeleton on the meta device, which ``setup`` materialises on the GPU
        (``materialise_on_device``): transformers' initialisation drawn there in milliseconds, not seconds of CPU
        (gpt2-medium fp32: 5.0 s; bf16 on the CPU: 16.4 s, H100 host, benchmarks/results/*-h100-startup/),
        and no host copy of a big model. The GPU's generator draws other numbers than the CPU's, so GPU runs start
        from other random weights than CPU runs of the same seed. Elsewhere, and with ``--samples`` (which
        completes the prompts with the model before training, on the CPU), the ordinary build on the CPU."""
        from ..training.models import build_model, meta_loadable

        if self.cfg.peft.method == "qlora":  # 4-bit from the start: a 70B architecture never exists in 16 bits
            from ..training import adapters

            return adapters.build_quantised(self.cfg, self.env.device, self.precision.dtype)
        if self.env.device.type == "cuda" and not self.cfg.samples and meta_loadable(self.cfg):
            return build_model(self.cfg, dtype=dtype, meta=True)
        return build_model(self.cfg, dtype=dtype)

    def materialise_on_device(self, model: nn.Module) -> nn.Module:
        """A ``build_on_device`` skeleton -> the same model on ``self.env.device``: seeded initialisation drawn
        there, then a local directory's files copied in one at a time. A model already built is returned as is."""
        if not any(p.is_meta for p in model.parameters()):
            return model
        from ..training import adapters
        from ..training.models import init_weights, load_local_weights

        model.to_empty(device=self.env.device)
        model.tie_weights()  # to_empty gives the tied head a tensor of its own (meta -> device is not an in-place move)
        torch.manual_seed(self.cfg.seed)
        with adapters.base_only(model) as base:  # with --peft: the base's draws as without adapters, then theirs
            init_weights(base)
        load_local_weights(model, self.cfg, lambda part: model.load_state_dict(part, strict=False))
        adapters.initialise(model, self.cfg.seed)
        return model

    @abstractmethod
    def setup(self, model: nn.Module, total_steps: int) -> None:
        """Wrap the model, build optimizer and scheduler. Collective."""

    @classmethod
    def cpu_optimizer(cls, cfg: RunConfig) -> bool:
        """Whether this run steps the optimizer on the CPU (offload): its threads are bound to the rank's
        cores and its steps are split into GPU compute / transfers / CPU optimizer / idle (timesplit.py)."""
        return False

    # what a strategy reads besides its own options: a user's DeepSpeed JSON (DeepSpeedStrategy), the pipeline's
    # stages, schedule and chunks (PipelineStrategy); given to another strategy, the JSON is refused, the options said unused
    reads_deepspeed_config = False
    takes_pipeline_options = False

    @classmethod
    def check_options(cls, run: ResolvedRun) -> None:
        """One-line refusals of settings this strategy cannot honour in the resolved ``run``; run before any process is
        spawned."""
        cfg, world, accum, device_type, s = run.cfg, run.world, run.accum or run.cfg.grad_accum or 1, run.device_type, run.spec
        opts = cfg.strategy_options
        # DeepSpeed's partial offload and ZenFlow, asked of a strategy that has neither (dp, fsdp, pipeline included)
        if opts.offload_ratio < 1.0 and not (s.engine == "deepspeed" and s.offload_params == "cpu"):
            raise UserError(f"offload_ratio {opts.offload_ratio} (partial offload) needs strategy zero3_offload, not {cfg.strategy!r}",
                            "use --strategy zero3_offload, or drop --offload-ratio")
        if opts.zenflow and not s.supports_zenflow:
            raise UserError(f"--zenflow needs strategy zero1_offload or zero2_offload, not {cfg.strategy!r}", "use --strategy zero2_offload")
        optim.check_optimizer_options(cfg, s, world, accum, device_type, run.precision.name)
        if cfg.peft.method:
            from ..training import adapters

            adapters.check(cfg, s, device_type)
        attention_backend.check(cfg.sdpa_backend, device_type)
        if cfg.compile and not s.supports_compile:
            raise UserError(f"--compile is not supported with strategy {cfg.strategy!r} in shardlab yet", "drop --compile or use dp, fsdp or a zero* strategy")
        if cfg.deepspeed_config and not cls.reads_deepspeed_config:
            raise UserError(f"--deepspeed-config given but strategy {cfg.strategy!r} does not use DeepSpeed", "pick a zero* strategy or drop --deepspeed-config")
        if not cls.takes_pipeline_options:
            _say_pipeline_options_unused(cfg)
        if cfg.loss_kernel == "liger":
            from ..training.models import build_hf_config

            loss.check_loss_kernel(cfg.loss_kernel, s, device_type, build_hf_config(cfg) if device_type == "cuda" else None)

    @staticmethod
    def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
        """How many ranks see different data (the batch triple's world size); pipeline stages share data."""
        return data_parallel_size(cfg, world_size)

    # ---- one optimizer step = grad_accum micro-batches ----------------------------------------------
    def step_label_tokens(self, local: int) -> float | torch.Tensor:
        """The step's label tokens over every data-parallel rank, from this rank's ``local`` count: a number on one
        process, else a device tensor (an all-reduce on the device's stream: no host sync)."""
        return summed(local, self.env.device) if self.env.is_distributed else float(local)

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        """Forward and backward of the next step's micro-batches from `batches` (a batches.DevicePrefetcher).

        Each micro-batch's mean loss is weighted by its label tokens over the step's (all ranks'), times the
        data-parallel size because the engines average gradients over ranks: the gradient is that of the step's
        token-weighted mean loss. Returns this rank's share of that mean (the ranks' shares sum to it; a device
        tensor) and its non-pad tokens.
        """
        step = next(batches)
        total = self.step_label_tokens(step.label_tokens)
        ranks = self.data_parallel_size(self.cfg, self.env.world_size)
        step_loss = torch.zeros((), device=self.env.device, dtype=torch.float32)
        if self.time_split.enabled and not self.time_split.h2d_bytes:  # first step: the engine has placed the model
            n = sum(getattr(p, "ds_numel", p.numel()) for p in self.hf_model.parameters())  # (ZeRO-3: partitioned)
            h2d, d2h = self.transfer_bytes_per_param()
            self.time_split.h2d_bytes, self.time_split.d2h_bytes = h2d * n, d2h * n
        self.time_split.compute_start()
        for i, micro in enumerate(step.micros):
            last = i == len(step.micros) - 1
            with self.accumulate(last):
                loss = self.forward(micro.batch)
                if micro.labels:
                    share = _as(micro.labels / total, loss)  # of the step's mean
                    self.backward(loss * (share * ranks), last)
                    step_loss += loss.detach().float() * share
                else:  # no label token: the model's mean is 0/0; a zero loss keeps the engines' hooks and collectives
                    self.backward(loss.nan_to_num() * 0.0, last)
            batches.preload()  # the next step's host work overlaps this step's device tail
        self.time_split.compute_end()
        return step_loss, step.useful

    def transfer_bytes_per_param(self) -> tuple[float, float]:
        """(host->device, device->host) bytes per parameter in one optimizer step, for offload strategies."""
        return 0.0, 0.0

    def autocast(self):
        """Autocast context for forward passes (a no-op for engines that cast weights themselves, and for bf16
        master weights: every op then runs in bf16 as under DeepSpeed and FSDP2, with no fp32 layer-norm outputs)."""
        if optim.autocasts(self.spec, self.cfg, self.precision.name):
            return torch.autocast(self.env.device.type, dtype=self.precision.dtype)
        return contextlib.nullcontext()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self.model is not None
        # With a loss_fn, and in eval (loss.chunked_causal_lm_loss), the model gets no labels: it returns logits, no loss.
        own = self.loss_fn is None and torch.is_grad_enabled()
        inputs = batch if own else {k: v for k, v in batch.items() if k != "labels"}
        # one unpadded sequence per row: the model's mask is plain causal, also while dynamo traces (sdpa_causal.py)
        unpacked = "attention_mask" not in inputs and "position_ids" not in inputs
        with attention_backend.context(self.cfg.sdpa_backend), sdpa_causal.unpacked_rows(unpacked):
            return self._forward(batch, inputs)

    def _forward(self, batch: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(self.loss_fn, loss.HeadFusedLoss):
            # liger: the model stops before its head (outputs.logits are the final hidden states) and the fused loss
            # applies the head's weight; inside autocast, so that its matmuls run in 16 bits as the head's would.
            head = loss.output_head(self.hf_model)
            with self.autocast():
                with loss.head_skipped(head):
                    outputs = self.model(**inputs, use_cache=False)
                return loss.model_loss(outputs, batch["labels"], lambda hidden, labels: self.loss_fn(hidden, labels, head),
                                       self.hf_model)
        with self.autocast():
            outputs = self.model(**inputs, use_cache=False)  # no KV cache in training: it only costs memory and time
        if torch.is_grad_enabled():
            return outputs.loss if self.loss_fn is None else loss.model_loss(outputs, batch["labels"], self.loss_fn, self.hf_model)
        # Eval (no grad) saves nothing for backward: an eager loss a chunk of tokens at a time, whatever the kernel (no
        # second compile inside the timed eval, and no fp32 copy of the whole logits: loss.chunked_causal_lm_loss).
        chunk_mib = self.cfg.eval_loss_chunk_mib
        return loss.model_loss(outputs, batch["labels"],
                               lambda logits, labels: loss.chunked_causal_lm_loss(logits, labels, chunk_mib), self.hf_model)

    def accumulate(self, last_micro: bool):
        """Context around forward+backward of one micro-batch (e.g. DDP's no_sync before the last)."""
        return contextlib.nullcontext()

    @abstractmethod
    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:
        """Backward of one micro-batch's weighted loss (train_step), as it is; `last_micro` ends the accumulation
        window."""

    @abstractmethod
    def optimizer_step(self) -> float | None:
        """Clip, step optimizer and scheduler, zero grads. Returns the pre-clip global grad norm."""

    @abstractmethod
    def current_lr(self) -> float: ...

    def train(self) -> None:
        assert self.model is not None
        self.model.train()

    def eval(self) -> None:
        assert self.model is not None
        self.model.eval()

    # ---- state ------------------------------------------------------------------------------------
    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Write model/optimizer/scheduler state into `directory` (exists, shared by all ranks). Collective."""

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """Restore what save_checkpoint wrote. Collective."""

    @abstractmethod
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Full, unsharded weights on CPU for export: the dict on rank 0, None elsewhere. Collective.
        ``trainable_only``: the parameters that train (a run's adapters), without gathering the frozen base."""

    def memory_note(self) -> str:
        """One line on where this strategy keeps parameters, gradients and optimizer states."""
        return ""

    def summary_extras(self) -> dict[str, Any]:
        """Strategy-specific figures for summary.json, at the end of training. Collective."""
        out: dict[str, Any] = {"optimizer": optim.arithmetic(self.cfg)}
        if self.time_split.enabled:
            out["time_split"] = self.time_split.summary()
            if self.env.is_main and out["time_split"]:
                messages.info(self.time_split.describe())
        out["cpu_threads"] = torch.get_num_threads()  # this rank's (rank 0's in summary.json): a CPU run's speed depends on it
        out["bound_cores"] = len(self.bound_cores)
        return out


def _say_pipeline_options_unused(cfg: RunConfig) -> None:
    """One line for pipeline options given to another strategy. Not an error: a bench's shared --set or a YAML written
    for several strategies carries them to every cell, and the run is the same without them."""
    from ..config import StrategyOptions

    fields = StrategyOptions.model_fields
    unused = [fields[k].json_schema_extra["cli"]["flag"] for k in ("pp_stages", "pp_schedule", "pp_chunks")
              if getattr(cfg.strategy_options, k) != fields[k].default]
    if unused:
        messages.info(f"{', '.join(unused)}: pipeline options, unused by strategy {cfg.strategy!r}")
