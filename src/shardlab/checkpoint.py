"""Checkpoints that are either complete or absent, resume, and HF-format export.

A checkpoint is written into `step-N.tmp/` by all ranks, then renamed to `step-N/` by
rank 0 after a barrier, and `latest` is replaced atomically: a job killed mid-save leaves
only a `.tmp` directory, which resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from .errors import UserError

TRAINER_STATE = "trainer_state.json"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def checkpoints_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def save(strategy, output_dir: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    """Collective: every rank writes its part; returns the final directory."""
    env = strategy.env
    root = checkpoints_root(output_dir)
    name = f"step-{trainer_state['global_step']:07d}"
    final, tmp = root / name, root / (name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    env.barrier()
    strategy.save_checkpoint(tmp)
    torch.save(_rng_state(), tmp / f"rng_rank{env.rank}.pt")
    env.barrier()
    if env.is_main:
        _atomic_write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write_text(root / "latest", name)
        _prune(root, keep)
    env.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def find_resume_dir(resume: str, output_dir: Path) -> Path | None:
    """'auto': the latest complete checkpoint under output_dir (None if there is none); else a path."""
    if resume == "auto":
        root = checkpoints_root(output_dir)
        latest = root / "latest"
        if latest.is_file():
            cand = root / latest.read_text().strip()
            if (cand / TRAINER_STATE).is_file():
                return cand
        done = sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file())
        return done[-1] if done else None
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise UserError(f"{resume!r} is not a complete shardlab checkpoint (no {TRAINER_STATE})", "pass --resume auto or a checkpoints/step-N directory")
    return path


def load(strategy, directory: Path) -> dict[str, Any]:
    """Collective: restore engine state and this rank's RNG; returns the trainer state."""
    strategy.load_checkpoint(directory)
    rng_file = directory / f"rng_rank{strategy.env.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((directory / TRAINER_STATE).read_text())


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export_hf(strategy, tokenizer, output_dir: Path) -> Path | None:
    """Collective: gather full weights and write a `from_pretrained`-loadable model directory."""
    state = strategy.full_state_dict()
    if not strategy.env.is_main:
        strategy.env.barrier()
        return None
    final = output_dir / "model"
    tmp = output_dir / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model = strategy.hf_model
    state = {k: v.contiguous() for k, v in state.items()}
    hf_model.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    strategy.env.barrier()
    return final
