"""Optimizer parameter groups, the optimizers and the learning-rate schedule (the precision: shardlab.runtime.resolved).

Shared by every strategy so that a strategy changes memory, not the mathematics:
the same decay/no-decay split, the same AdamW hyper-parameters, the same schedule.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch import nn

from ..config import RunConfig
from ..errors import UserError
from ..specs.registry import StrategySpec, spec


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


def adamw(model: nn.Module, cfg: RunConfig, device_type: str, cpu_fused: bool = False) -> torch.optim.Optimizer:
    """torch's AdamW. `cpu_fused`: the optimizer steps CPU-resident (offloaded) states, where torch's fused CPU
    kernel (vectorised, OpenMP-parallel over the rank's threads) is several times faster than its default
    single-tensor loop. Plain CPU runs keep the single-tensor path, whose small temporaries the plan models."""
    # fused AdamW is the fastest torch kernel on CUDA; on CPU torch picks its single-tensor path unless asked.
    fused = device_type == "cuda" or cpu_fused
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=fused,
    )


# ---- beyond exact fp32 AdamW: 8-bit moments, the step inside backward -------------------------------------

TORCHAO_HINT = "pip install 'shardlab[offload]' (torchao)"


def quiet_import(module: str, loggers: tuple[str, ...], missing: str, hint: str):
    """``import module`` with the named loggers at ERROR and warnings off while it imports (optional libraries that
    log what they could not load here), or a one-line error: ``missing`` and the ``hint`` that installs it."""
    import importlib

    quieted = [logging.getLogger(name) for name in loggers]
    levels = [lg.level for lg in quieted]
    for lg in quieted:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError:
        raise UserError(missing, hint) from None
    finally:
        for lg, level in zip(quieted, levels):
            lg.setLevel(level)


def torchao_optim():
    """torchao.optim, or a one-line error naming the extra that installs it (imported here: it is optional)."""
    # torchao logs a warning per optional CUDA kernel library its wheel cannot load here (none of them
    # is used by torchao.optim) and torch warns about one of its enums: noise in every run's log.
    return quiet_import("torchao.optim", ("torchao", "torch.utils._pytree"), "this option needs torchao, which is not installed",
                        TORCHAO_HINT)


def arithmetic(cfg: RunConfig) -> str:
    """What the optimizer computes, in words, for the logs and summary.json."""
    base = {"adamw": "exact fp32 AdamW",
            "adamw8bit": "8-bit AdamW (torchao AdamW8bit: block-wise quantised moments, not bit-exact AdamW)"}[cfg.optimizer]
    if cfg.strategy_options.zenflow and spec(cfg.strategy).supports_zenflow:
        base = "ZenFlow AdamW (DeepSpeed: important gradient columns every step on the GPU, the rest later on the CPU; not bit-exact AdamW)"
    if cfg.optimizer_in_backward:
        base += ", stepped in backward per parameter (no global-norm clipping)"
    if bf16_master(cfg):
        base += ", on bf16 weights and gradients (no fp32 master copy; each update rounded into bf16 stochastically)"
    return base


def check_optimizer_options(cfg: RunConfig, s: StrategySpec, world: int, accum: int, device_type: str, precision: str) -> None:
    """One-line refusals of optimizer options a strategy or a setting cannot honour (launch preflight and setup)."""
    strategy = s.name
    if cfg.optimizer == "adamw8bit":
        if not s.supports_8bit:
            raise UserError(f"--optimizer adamw8bit is not supported with strategy {strategy!r}", "use --strategy dp or fsdp")
        torchao_optim()
    if cfg.master_weights == "bf16":
        check_bf16_master(cfg, s, precision)
    if not cfg.optimizer_in_backward:
        return
    if not s.supports_in_backward:
        raise UserError(f"--optimizer-in-backward is not supported with strategy {strategy!r}", "use --strategy dp (one rank) or fsdp")
    if s.engine == "ddp" and world > 1:
        # DDP all-reduces after the gradient hooks fire: a step there would use this rank's gradient only.
        raise UserError("--optimizer-in-backward with dp needs one rank (DDP reduces gradients after the hooks run)",
                        "use --strategy fsdp for several ranks")
    if accum > 1:
        raise UserError(f"--optimizer-in-backward cannot accumulate gradients (grad_accum {accum}): each gradient is applied and freed "
                        "as soon as backward produces it", "use --grad-accum 1 (raise --micro-batch instead)")
    if cfg.max_grad_norm is not None:
        raise UserError("--optimizer-in-backward cannot clip by the global gradient norm (each parameter steps before the others' "
                        "gradients exist)", "pass --set max_grad_norm=null")
    if cfg.nan_policy == "skip":
        raise UserError("--optimizer-in-backward cannot skip a step with non-finite gradients (it is applied during backward)",
                        "use --nan-policy stop")
    if cfg.precision == "fp16" or (cfg.precision == "auto" and device_type == "cuda" and not torch.cuda.is_bf16_supported()):
        raise UserError("--optimizer-in-backward does not work with fp16 loss scaling (unscaling needs every gradient first)",
                        "use --precision bf16 or fp32")


def check_bf16_master(cfg: RunConfig, s: StrategySpec, precision: str) -> None:
    """--master-weights bf16: only where the weights stay plain tensors the optimizer rounds into (dp), with an
    optimizer that rounds stochastically (torch's AdamW on bf16 weights keeps bf16 moments and drops every update
    smaller than half a bf16 step), and with bf16 compute (the weights are bf16: fp32 or fp16 compute would be a cast
    of every weight at every use)."""
    if not s.supports_bf16_master:
        raise UserError(f"--master-weights bf16 is not supported with strategy {s.name!r}", "use --strategy dp")
    if cfg.optimizer != "adamw8bit":
        raise UserError("--master-weights bf16 needs --optimizer adamw8bit (torchao's AdamW8bit rounds each update into the "
                        "bf16 weights stochastically; torch's AdamW would lose updates smaller than bf16's step)",
                        "add --optimizer adamw8bit, or drop --master-weights bf16")
    if precision != "bf16":
        raise UserError(f"--master-weights bf16 needs bf16 compute, not {precision}",
                        "pass --precision bf16")


def bf16_master(cfg: RunConfig) -> bool:
    return cfg.master_weights == "bf16"


def autocasts(s: StrategySpec, cfg: RunConfig, precision: str) -> bool:
    """Whether forward runs under torch.autocast: the one answer the run (Strategy.autocast, the pipeline's stages) and
    the planner read. A 16-bit ``precision`` over fp32 weights does, except where the engine casts the weights itself
    (``spec.uses_autocast`` False: DeepSpeed, FSDP2) and with bf16 master weights, where every op already runs in bf16."""
    return s.uses_autocast and precision != "fp32" and not (bf16_master(cfg) and s.supports_bf16_master)


def optimizer_class(cfg: RunConfig):
    """(class, extra kwargs) of the per-group optimizer the options ask for."""
    if cfg.optimizer == "adamw8bit":
        return torchao_optim().AdamW8bit, eight_bit_kwargs(cfg)
    return torch.optim.AdamW, {}


def eight_bit_kwargs(cfg: RunConfig) -> dict:
    # bf16 weights: round-to-nearest would drop every update below half a bf16 step (lr 1e-5 x a weight of 0.02 is
    # ~1/500 of one); stochastic rounding keeps them in expectation (torchao optim/adam.py, torchtune's bf16 recipes).
    return {"bf16_stochastic_round": True} if bf16_master(cfg) else {}


def build(model: nn.Module, cfg: RunConfig, device_type: str, cpu_fused: bool = False) -> torch.optim.Optimizer:
    """The run's optimizer: exact AdamW, torchao AdamW8bit, either of them stepped in backward."""
    if cfg.optimizer_in_backward:
        return InBackwardOptimizer(model, cfg, device_type)
    if cfg.optimizer == "adamw8bit":
        return torchao_optim().AdamW8bit(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                         eps=cfg.adam_eps, weight_decay=cfg.weight_decay, **eight_bit_kwargs(cfg))
    return adamw(model, cfg, device_type, cpu_fused)


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped in that parameter's post-accumulate-grad hook, which then frees the
    gradient: at most one parameter's gradient is alive at a time instead of all of them (torchtune's
    optimizer-in-backward). FSDP2 runs the same hooks on the sharded parameter after its reduce-scatter.

    It subclasses Optimizer without calling its __init__ (as torchao's CPUOffloadOptimizer does) so that torch's
    lr schedulers, which read and write ``param_groups``, drive every per-parameter optimizer's lr; ``step`` is a
    no-op (the work happened in backward). ``state_dict`` maps parameter names to each optimizer's state, so a
    checkpoint resumes into the same model; DCP's optimizer helpers do not understand it (see the strategies)."""

    def __init__(self, model: nn.Module, cfg: RunConfig, device_type: str):
        cls, kwargs = optimizer_class(cfg)
        if cls is torch.optim.AdamW and device_type == "cuda":
            kwargs = {**kwargs, "fused": True}
        self.names = {p: n for n, p in model.named_parameters()}
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in param_groups(model, cfg.weight_decay):
            for p in group["params"]:
                self.optimizers[p] = cls([p], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                         weight_decay=group["weight_decay"], **kwargs)
                p.register_post_accumulate_grad_hook(self._hook)
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        self.defaults = {"lr": cfg.lr}
        self.state = {}  # the per-parameter optimizers own the state; torch's Optimizer API expects the attribute

    def _hook(self, p: torch.Tensor) -> None:
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self, closure=None):  # noqa: ARG002 - the update ran in backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # gradients are freed in the hooks already
        return None

    def state_dict(self) -> dict:
        return {self.names[p]: opt.state_dict() for p, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        for p, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[self.names[p]])


def lr_lambda(cfg: RunConfig, total_steps: int):
    """Multiplier of the peak lr at optimizer step `step` (0 for the first): linear warm-up, then cosine/linear/constant,
    as transformers' get_scheduler computes them ("cosine_with_min_lr", "linear", "constant_with_warmup"), so that a run
    and its Trainer twin step with the same rates. Warm-up starts from 0 (step k of W uses k/W of the peak); the linear
    decay's floor (min_lr_ratio) is shardlab's own, 0 by default as in transformers."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return step / warmup
        if cfg.lr_schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if cfg.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
