"""Elastic resume: a checkpoint written under one strategy / number of ranks, resumed under another.

Supported pairs (anything else is a UserError naming them):

    dp, fsdp, fsdp_offload,     -> dp, fsdp, fsdp_offload, pipeline; any number of ranks (and of stages)
    pipeline                       natively: all write torch.distributed.checkpoint (DCP) under the HF model's
                                   parameter names (a pipeline stage maps its names back to the model's), and
                                   DCP reshards on load: each rank reads only the tensors it holds.
    zero1/2/3 (+ _offload)      -> zero1/2/3 (+ _offload), any number of ranks
        through DeepSpeed's universal checkpoint (deepspeed.checkpoint.ds_to_universal), made once
        per checkpoint into its `universal/` folder and loaded with DeepSpeed's `load_universal`.
    zero1/2/3 (+ _offload)      -> dp, fsdp, fsdp_offload, any number of ranks
        the universal checkpoint's full fp32 weights and Adam moments, by parameter name.

Not supported (resume them with the strategy and number of ranks they were written with):
dp/fsdp/pipeline -> ZeRO (DeepSpeed can only load its own universal format), zero0 and infinity (no
partitioned optimizer files / NVMe swap state), ZeRO -> pipeline (not tested).

What carries over: weights, AdamW moments and step, the lr schedule, the data position (a step
counts `global_batch` samples whatever the layout, so the global batch must stay the same).
RNG streams are per rank and continue only when the number of ranks is unchanged; with dropout 0
(or none) the losses continue as an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..compat.universal_checkpoint import loadable_by_every_stage
from ..errors import UserError
from ..specs.registry import lookup
from ..training.adapters import layout as adapter_layout

# Lazy imports below: deepspeed (seconds to import) loads only when a DeepSpeed checkpoint is resharded.

# Checkpoint formats (StrategySpec.checkpoint_format) this module converts between.
TORCH_DCP = "torch_dcp"
ZERO = "deepspeed_zero"


def checkpoint_format(strategy: str | None) -> str | None:
    """How `strategy`'s checkpoints are laid out; None for a name no strategy has (an old checkpoint's)."""
    found = lookup(strategy)
    return found.checkpoint_format if found is not None else None


UNIVERSAL_DIR = "universal"
DS_TAG = "deepspeed"  # strategies/deepspeed_zero.CKPT_TAG

SUPPORTED = (
    "dp/fsdp/fsdp_offload/pipeline -> dp/fsdp/fsdp_offload/pipeline; zero1/2/3(_offload) -> zero1/2/3(_offload), dp, fsdp, "
    "fsdp_offload; each on any number of ranks (and pipeline stages) with the same global batch"
)


def layout(run) -> dict[str, Any]:
    """How the resolved ``run`` is laid out; stored in every checkpoint's trainer_state.json."""
    cfg = run.cfg
    return {"strategy": cfg.strategy, "world_size": run.world, "dp_size": run.dp_size, "micro_batch": run.micro,
            "grad_accum": run.accum, "global_batch": run.global_batch, "pp_stages": cfg.strategy_options.pp_stages,
            "weight_decay": cfg.weight_decay, "adapter": adapter_layout(cfg, run.device_type, run.precision.name)}  # fmt: skip


def check_kept_settings(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """What a resume must keep: the global batch (the data position) and the weight decay."""
    if saved["global_batch"] != now["global_batch"]:
        raise UserError(
            f"the checkpoint was written with global batch {saved['global_batch']}, this run uses {now['global_batch']}: "
            "the data position (steps x global batch) would not match",
            f"resume with --global-batch {saved['global_batch']} (any micro batch / accumulation / GPU count that gives it)",
        )
    # The optimizer state carries its groups' weight decay (a changed value would be ignored), and
    # decay 0 means one group instead of two (optim.param_groups).
    if "weight_decay" not in saved and now.get("weight_decay") == 0:  # written before decay 0 became one group
        raise UserError(
            "the checkpoint was written by an older shardlab, whose optimizer state has two parameter groups even without weight decay",
            "resume it with the shardlab version that wrote it, or export the model (`shardlab export`) and fine-tune from it",
        )
    # A checkpoint of adapters holds no base weights: the resume rebuilds them, and must rebuild the same ones, with the
    # same adapters; a full checkpoint has no adapters to load, an adapter one no base to fine-tune fully.
    if saved.get("adapter") != now.get("adapter"):
        def what(a):
            if not a:
                return "full fine-tuning"
            seed = "" if a.get("seed") is None else f", seed {a['seed']}"  # a pretrained base does not depend on it
            return f"--peft {a['method']} (r {a['r']}, alpha {a['alpha']:g}, targets {a['target_modules']}, model {a['model']}{seed})"
        raise UserError(f"the checkpoint was written by {what(saved.get('adapter'))}, this run is {what(now.get('adapter'))}",
                        "resume with the --peft settings, --model and --seed it was written with")
    if "weight_decay" in saved and saved["weight_decay"] != now.get("weight_decay"):
        raise UserError(
            f"the checkpoint was written with weight decay {saved['weight_decay']}, this run uses {now['weight_decay']}",
            f"resume with --weight-decay {saved['weight_decay']}, or export the model (`shardlab export`) and fine-tune from it",
        )


def loads_natively(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    if checkpoint_format(saved["strategy"]) == checkpoint_format(now["strategy"]) == TORCH_DCP:
        return True
    return saved["strategy"] == now["strategy"] and saved["world_size"] == now["world_size"] and saved.get("pp_stages") == now.get("pp_stages")


def supported(src: str, dst: str) -> bool:
    to_pipeline = getattr(lookup(dst), "engine", None) == "pipelining"  # its stages take no universal checkpoint (untested)
    src, dst = checkpoint_format(src), checkpoint_format(dst)
    return (src == TORCH_DCP and dst == TORCH_DCP) or (src == ZERO and (dst == ZERO or (dst == TORCH_DCP and not to_pipeline)))


def check_pair(saved: dict[str, Any], now: dict[str, Any]) -> None:
    check_kept_settings(saved, now)
    src, dst = saved["strategy"], now["strategy"]
    if saved.get("adapter") and not loads_natively(saved, now):  # reshard.py converts whole models' states only
        raise UserError(f"a {src} checkpoint of adapters written on {saved['world_size']} rank(s) cannot be resumed as {dst} "
                        f"on {now['world_size']} rank(s)",
                        f"resume it as {src} on {saved['world_size']} rank(s) (dp, fsdp: any number of ranks), or export its adapter "
                        "(`shardlab export`)")
    if not loads_natively(saved, now) and not supported(src, dst):
        raise UserError(
            f"a {src} checkpoint written on {saved['world_size']} rank(s) cannot be resumed as {dst} on {now['world_size']} rank(s)",
            f"resume it as {src} on {saved['world_size']} rank(s), or export it (`shardlab export`) and fine-tune from the model; supported: {SUPPORTED}",
        )



def load(strategy, directory: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Collective: load a checkpoint written under another layout into `strategy`."""
    check_pair(saved, now)
    dst = now["strategy"]
    universal = ensure_universal(directory, strategy.env)
    if checkpoint_format(dst) == ZERO:
        strategy.load_checkpoint(directory, tag=UNIVERSAL_DIR, universal=True)
    else:
        strategy.load_full_state(read_universal(universal))


# ---- DeepSpeed universal checkpoints -----------------------------------------------------------------


def ensure_universal(directory: Path, env) -> Path:
    """Collective: rank 0 converts `directory`'s ZeRO shards once (atomically); every rank gets the path."""
    out = directory / UNIVERSAL_DIR
    if env.is_main and not out.is_dir():
        convert_to_universal(directory, out)
    env.barrier()
    return out


def convert_to_universal(directory: Path, out: Path) -> Path:
    """DeepSpeed's own converter (what `python -m deepspeed.checkpoint.ds_to_universal` runs), into `out`."""
    source = directory / DS_TAG
    if not source.is_dir():
        raise UserError(f"{str(directory)!r} holds no DeepSpeed checkpoint", "pass a checkpoint written by a zero* strategy")
    for stale in out.parent.glob(out.name + ".tmp*"):  # a conversion killed half-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        _convert(source, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    return out


def _convert(source: Path, tmp: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source), output_folder=str(tmp), num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # its progress bars are noise in a training log
        ds_to_universal.main(args)
    loadable_by_every_stage(source, tmp, load_deepspeed_file)  # compat/universal_checkpoint.py


def load_deepspeed_file(path: Path, mmap: bool = False) -> Any:
    """A DeepSpeed checkpoint file, with weights_only=True plus the few DeepSpeed classes it pickles (``mmap``: the
    tensors stay on disk until read)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address  # (numel, start) of a ZeRO-1/2 parameter's slice

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


@dataclass
class FullState:
    """Unsharded fp32 training state keyed by parameter name."""

    model: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq"}
    step: int
    scheduler: dict[str, Any] | None


def read_universal(universal: Path, with_optimizer: bool = True) -> FullState:
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    step = 0
    def tensor(path: Path) -> torch.Tensor:  # {"param": t, ...} (compat/universal_checkpoint.py) or the tensor
        x = torch.load(path, map_location="cpu", weights_only=True)
        return x["param"] if isinstance(x, dict) else x

    for param_dir in sorted(p for p in (universal / "zero").iterdir() if p.is_dir()):
        name = param_dir.name
        model[name] = tensor(param_dir / "fp32.pt")
        if not with_optimizer:
            continue
        moments = {k: tensor(param_dir / f"{k}.pt") for k in ("exp_avg", "exp_avg_sq") if (param_dir / f"{k}.pt").is_file()}
        if moments:
            optim[name] = moments
        if (param_dir / "step.pt").is_file():
            step = max(step, int(torch.load(param_dir / "step.pt", map_location="cpu", weights_only=True)))
    scheduler = None
    states = sorted(universal.glob("mp_rank_*_model_states.pt"))
    if with_optimizer and states:
        scheduler = load_deepspeed_file(states[0]).get("lr_scheduler")
    return FullState(model, optim, step, scheduler)
