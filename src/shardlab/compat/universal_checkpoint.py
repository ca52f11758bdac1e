"""DeepSpeed's universal checkpoint rewritten so that every ZeRO stage loads it, whichever stage wrote it.

``deepspeed.checkpoint.ds_to_universal`` writes the source stage's form of the files, and DeepSpeed's universal
loaders (0.19.8) read each stage's own form: a ZeRO-1/2 checkpoint converted for ZeRO-3, or the reverse, fails to
load. checkpoint/reshard.py converts a checkpoint once (into its ``universal/`` folder), then this rewrites the result:

- the universal checkpoint's metadata (lr schedule, counters; the weights come from ``zero/``) is read from the file
  name the *loading* stage writes: both names are given;
- ZeRO-3 writes each tensor flat, ZeRO-1/2 read ``{"param": full-shape tensor}`` (ZeRO-3 accepts that too);
- ``zero/optimizer_state.pt``: 1/2 want top-level ``param_groups`` and ``ds_version``; 3 wants
  ``optimizer_state_dict`` with a step; 1/2 read a step per parameter.

Outside the DeepSpeed versions it was tested on, the universal checkpoint stays as DeepSpeed wrote it: it loads into
the stage that wrote it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from . import applied, enabled

# The names DeepSpeed's stages give a universal checkpoint's metadata file (ZeRO-1/2, ZeRO-3).
STATES_NAMES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def loadable_by_every_stage(source: Path, tmp: Path, load: Callable[[Path], Any]) -> None:
    """Rewrite the universal checkpoint in ``tmp`` converted from the DeepSpeed checkpoint ``source``; ``load`` reads
    one of DeepSpeed's files (checkpoint/reshard.load_deepspeed_file: weights only, DeepSpeed's few classes)."""
    if not enabled("universal_checkpoint"):
        return
    present = [n for n in STATES_NAMES if (tmp / n).is_file()]
    if not present:
        present = [p.name for p in sorted(source.glob("*model_states.pt"))[:1]]
        if present:
            shutil.copy2(source / present[0], tmp / present[0])
    for name in STATES_NAMES:
        if present and not (tmp / name).is_file():
            shutil.copy2(tmp / present[0], tmp / name)
    _normalize(tmp / "zero", load)
    applied("universal_checkpoint")


def _normalize(zero: Path, load: Callable[[Path], Any]) -> None:
    """zero/optimizer_state.pt and the per-parameter files as both ZeRO-1/2 and ZeRO-3 read them."""
    import deepspeed

    # ZeRO-3 writes each tensor flat; ZeRO-1/2 read {"param": full-shape tensor} (ZeRO-3 accepts that too).
    shapes: dict[str, Any] = {}
    for states in sorted(zero.parent.glob("*model_states.pt"))[:1]:
        found = load(states).get("param_shapes") or []
        for group in [found] if isinstance(found, dict) else found:
            shapes.update(group)
    for file in zero.glob("*/*.pt"):
        if file.stem in ("fp32", "exp_avg", "exp_avg_sq"):
            x = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(x, dict):
                shape = shapes.get(file.parent.name)
                torch.save({"param": x.reshape(shape) if shape is not None else x, "cat_dim": 0}, file)

    path = zero / "optimizer_state.pt"
    sd = load(path)
    inner = sd.get("optimizer_state_dict") or {}
    groups = sd.get("param_groups") or inner.get("param_groups")
    step_files = sorted(zero.glob("*/step.pt"))
    if step_files:  # ZeRO-1/2 source: a step per parameter
        step = torch.load(step_files[0], map_location="cpu", weights_only=True)
    else:  # ZeRO-3 source: one step in the optimizer state; ZeRO-1/2 targets read it per parameter
        step = next(iter(inner.get("state", {}).values()), {}).get("step", torch.tensor(0.0))
        for moments in zero.glob("*/exp_avg.pt"):
            torch.save(step, moments.parent / "step.pt")
    sd.setdefault("param_groups", groups)
    sd.setdefault("ds_version", deepspeed.__version__)
    if not inner.get("state"):
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": groups}
    torch.save(sd, path)
