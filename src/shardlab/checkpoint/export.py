"""`shardlab export CKPT OUT`: any shardlab checkpoint, of any strategy, as a Hugging Face model + tokenizer.

Runs in one process without GPUs or a process group: the shards are read offline.
    dp, fsdp, fsdp_offload,  torch.distributed.checkpoint read without a process group (a pipeline's stages are
    pipeline                 saved under the whole model's names, so one reader serves all of them)
    zero1/2/3 (+ _offload)   DeepSpeed's zero_to_fp32: the ranks' fp32 master partitions, merged
    zero0                    the full module DeepSpeed stores in its model-states file
The directory is written like the end-of-run export (checkpoint.save_hf: tmp dir, then rename).

A --peft checkpoint holds the adapters only (and their optimizer states): it is exported as peft's adapter directory
(no base weights are built), or with --merge as the base model, rebuilt as the run built it, with the adapters merged
into its weights (peft's merge_and_unload).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import torch

from .. import messages
from . import store as checkpoint, reshard, trust
from ..config import RunConfig, load_config
from ..errors import UserError
from ..strategies.torch_optim import CKPT_DIR

# Lazy imports below: transformers, torch.distributed.checkpoint and deepspeed load only for the kind of checkpoint
# being exported.


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoints/step-N directory, or a run directory (its newest complete checkpoint)."""
    p = Path(path)
    if checkpoint.is_complete(p):
        return p
    if (p / "checkpoints").is_dir():
        found = checkpoint.find_resume_dir("auto", p)
        if found is not None:
            return found
    raise UserError(f"{str(p)!r} is neither a complete checkpoint nor a run directory with one", "pass OUTPUT_DIR or OUTPUT_DIR/checkpoints/step-N")


def checkpoint_config(ckpt: Path) -> RunConfig:
    for candidate in (ckpt / checkpoint.CONFIG_FILE, ckpt.parent.parent / "config.yaml"):  # older checkpoints: the run's
        if candidate.is_file():
            return load_config(candidate)
    raise UserError(f"no config.yaml in {str(ckpt)!r} or its run directory", "export from a checkpoint written by shardlab")


def _meta_model(cfg: RunConfig):
    from transformers import AutoModelForCausalLM

    from ..training.models import build_hf_config

    with torch.device("meta"):  # names and shapes only; the weights come from the checkpoint
        return AutoModelForCausalLM.from_config(build_hf_config(cfg), dtype=torch.float32)


def full_weights(ckpt: Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Every weight of the model, full and fp32, keyed by the model's state_dict names."""
    model = _meta_model(cfg)
    return _complete(_stored_weights(ckpt, cfg, {k: v.shape for k, v in model.state_dict().items()}, "model"), model)


def _stored_weights(ckpt: Path, cfg: RunConfig, shapes: dict[str, torch.Size], what: str) -> dict[str, torch.Tensor]:
    """The weights ``ckpt`` stores, fp32, read in the format its strategy wrote (``shapes``: the names and shapes a
    DCP checkpoint is read into); ``what`` names the export the run itself would have written instead."""
    strategy = (checkpoint.read_state(ckpt).get("layout") or {}).get("strategy", cfg.strategy)
    fmt = reshard.checkpoint_format(strategy)
    if fmt == reshard.TORCH_DCP:
        return _dcp_weights(ckpt, shapes)
    if fmt == reshard.ZERO:
        return _zero_weights(ckpt)
    if fmt == "deepspeed_stage0":
        return _zero0_weights(ckpt)
    raise UserError(f"export of {strategy} checkpoints is not supported", f"set `export: true` so the run exports its {what} at the end")


def _complete(found: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Fill tied names (GPT-2's lm_head is wte) and check that nothing is missing; shapes from the model."""
    params = dict(model.named_parameters(remove_duplicate=False))
    same: dict[int, list[str]] = {}
    for name, p in params.items():
        same.setdefault(id(p), []).append(name)
    out: dict[str, torch.Tensor] = {}
    by_param: dict[int, torch.Tensor] = {}  # one tensor per parameter, so save_pretrained sees the tie
    for name, meta in model.state_dict().items():
        key = id(params[name]) if name in params else id(meta)
        if key in by_param:
            out[name] = by_param[key]
            continue
        source = next((a for a in [name, *same.get(key, [])] if a in found), None)
        if source is None:
            raise UserError(f"the checkpoint has no weight {name!r} of {type(model).__name__}", "export with the config the checkpoint was written with")
        out[name] = by_param[key] = found[source].reshape(meta.shape).float()
    return out


def _dcp_weights(ckpt: Path, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    wanted = {"model": {k: torch.empty(shape, dtype=torch.float32) for k, shape in shapes.items()}}
    # tied names may be stored once: load what is there, _complete fills the rest
    dcp.load(wanted, checkpoint_id=str(ckpt / CKPT_DIR), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    stored = _dcp_keys(ckpt / CKPT_DIR)
    return {k: v for k, v in wanted["model"].items() if f"model.{k}" in stored}


def _dcp_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _zero_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every weight, fp32, merged from the ranks' fp32 master partitions by DeepSpeed's own
    `deepspeed.utils.zero_to_fp32` (any ZeRO stage, any number of ranks). It reads the master weights only (the files
    memory-mapped, the Adam moments dropped) and writes nothing; the universal-checkpoint conversion used before wrote
    every optimizer state to a temporary directory first (12 bytes a parameter: 85 GB for bloom-7b1).
    DeepSpeed unpickles with weights_only=False: export_checkpoint has screened the files first (trust.py), unless
    shardlab wrote them for this user or the user trusts them."""
    source = ckpt / reshard.DS_TAG
    files = sorted(source.glob("*_optim_states.pt")) + sorted(source.glob("*_model_states.pt"))
    if not files:
        raise UserError(f"{str(ckpt)!r} holds no DeepSpeed ZeRO checkpoint ({reshard.DS_TAG}/*_optim_states.pt)",
                        "pass a checkpoint written by a zero* strategy")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=reshard.DS_TAG)


def _zero0_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    files = sorted((ckpt / reshard.DS_TAG).glob("mp_rank_*_model_states.pt"))
    if not files:
        raise UserError(f"{str(ckpt)!r} holds no DeepSpeed model states", "pass a checkpoint written by strategy zero0")
    state = reshard.load_deepspeed_file(files[0])
    return {k: v for k, v in state["module"].items()}


def adapter_weights(ckpt: Path, cfg: RunConfig, model) -> dict[str, torch.Tensor]:
    """A --peft checkpoint's adapters, fp32, keyed by ``model``'s (the peft model's) parameter names."""
    from ..training import adapters

    names = {n: p for n, p in adapters.adapter_parameters(model)}
    found = _stored_weights(ckpt, cfg, {n: p.shape for n, p in names.items()}, "adapter")
    missing = sorted(set(names) - set(found))
    if missing:
        raise UserError(f"the checkpoint has no adapter weight {missing[0]!r}", "export with the config the checkpoint was written with")
    return {n: found[n].reshape(p.shape).float() for n, p in names.items()}


def _export_adapter(ckpt: Path, cfg: RunConfig, out: Path, merge: bool, tokenizer) -> Path:
    """A --peft checkpoint as peft's adapter directory, or (``merge``) as the base model with the adapters merged in
    (peft's merge_and_unload): a plain transformers model."""
    from ..training import adapters

    saved = (checkpoint.read_state(ckpt).get("layout") or {}).get("adapter")
    if saved is None:  # a checkpoint written before adapters were recorded: this machine's reading of the config
        from ..runtime.distributed import pick_device_type
        from ..runtime.resolved import resolve_precision

        device = pick_device_type(cfg.device)
        saved = adapters.layout(cfg, device, resolve_precision(cfg.precision, device).name)
    cfg = cfg.model_copy(update={"model": saved["model"], "seed": cfg.seed if saved.get("seed") is None else saved["seed"]})
    if not merge:  # names and shapes are all an adapter directory needs: no base weights are built
        model = adapters.apply(_meta_model(cfg), cfg)
        weights = adapter_weights(ckpt, cfg, model)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        adapters.save_adapter(model, weights, tmp, cfg, saved)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return out
    base = adapters.rebuild_base(cfg, saved)
    model = adapters.apply(base, cfg)
    weights = adapter_weights(ckpt, cfg, model)
    with torch.no_grad():
        for name, param in adapters.adapter_parameters(model):
            param.copy_(weights[name])
    merged = model.merge_and_unload()
    return checkpoint.save_hf(merged, merged.state_dict(), tokenizer, out)


def export_checkpoint(path: str | Path, out: str | Path, merge: bool = False, trusted: bool = False) -> Path:
    """The checkpoint as a Hugging Face model directory, with the run's tokenizer; a preset's offline tokenizer that
    cannot load here (its package not installed) leaves the model alone, said in one line. A --peft checkpoint gives
    peft's adapter directory, or with ``merge`` the model with its adapters merged in. A checkpoint shardlab did not
    write for this user is screened first, or refused unless ``trusted`` (trust.py); its config's remote code runs only
    when trusted."""
    from ..training.tokenizing import load_tokenizer, offline_tokenizer_problem

    ckpt = resolve_checkpoint(path)
    how = trust.check_checkpoint(ckpt, trusted, f"export {path}", messages.info)
    cfg = checkpoint_config(ckpt)
    if how == "screened" and cfg.trust_remote_code:  # a foreign config.yaml is not the user's consent to run code
        cfg = cfg.model_copy(update={"trust_remote_code": False})
    if merge and not cfg.peft.method:
        raise UserError(f"--merge merges adapters, and {str(ckpt)!r} is a checkpoint of full fine-tuning", "drop --merge")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{str(out)!r} exists and is not empty", "pass a new directory")
    problem = offline_tokenizer_problem(cfg)
    tokenizer = load_tokenizer(cfg) if problem is None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.peft.method:
        final = _export_adapter(ckpt, cfg, out, merge, tokenizer)
    else:
        final = checkpoint.save_hf(_meta_model(cfg), full_weights(ckpt, cfg), tokenizer, out)
    if problem is not None:
        messages.info(f"exported the model without tokenizer files: {problem.message}")
    return final
