"""Checkpoints that are either complete or absent, resume, and HF-format export.

A checkpoint is written into `step-N.tmp/` by all ranks, fsynced, then renamed to `step-N/` by
rank 0 after a barrier, and `latest` is replaced atomically: a job killed mid-save leaves only a
`.tmp` directory, which resume ignores and the next save removes. Besides the engine's state a
checkpoint holds every rank's RNG state (`rng_rankR.pt`), the data position and the layout it was
written with (`trainer_state.json`) and the resolved run config (`config.yaml`).

Resuming under another strategy or number of ranks goes through reshard.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runtime import faults
from . import reshard, trust
from ..errors import UserError
from ..measure.records import write_text_atomic

TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a directory fsync; a no-op where unsupported)."""
    try:
        _fsync_file(path)
    except OSError:
        pass


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


BEST = "best"  # checkpoints/best: the lowest eval loss so far (--save-best)
OLD = ".old"  # the copy a re-save renames aside until the new one is in place (replace_dir)
EXPORT_DIR = "model"  # OUTPUT_DIR/model: the exported HF model


def checkpoints_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def save(strategy, output_dir: Path, trainer_state: dict[str, Any], keep: int, config_text: str | None = None,
         name: str | None = None) -> Path:
    """Collective: every rank writes its part; returns the final directory.

    `name` (e.g. BEST) writes checkpoints/NAME instead of step-N, outside the rotation: `latest`,
    resume and pruning see only step-N directories.
    """
    env = strategy.env
    root = checkpoints_root(output_dir)
    step = trainer_state["global_step"]
    rotated = name is None
    name = name or f"step-{step:07d}"
    final, tmp = root / name, root / (name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    env.barrier()
    strategy.save_checkpoint(tmp)
    torch.save(_rng_state(), tmp / f"rng_rank{env.rank}.pt")
    faults.in_save(step, env.rank)
    env.barrier()
    _fsync_tree(tmp)  # each rank: nothing is renamed into place before every rank's bytes are on disk
    env.barrier()
    if env.is_main:
        trust.seal(tmp)  # every rank's pickles, under this user's key: a resume knows it wrote them (trust.py)
        if config_text is not None:
            write_text_atomic(tmp / CONFIG_FILE, config_text)
        write_text_atomic(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=1))  # last: marks it complete
        replace_dir(tmp, final)
        if rotated:
            write_text_atomic(root / "latest", name)
            _prune(root, keep)
    env.barrier()
    return final


def replace_dir(tmp: Path, final: Path) -> Path:
    """``tmp`` (complete) becomes ``final``, an earlier copy there (a re-saved checkpoints/best, model/) renamed aside
    before it is deleted: at every moment a complete copy is under ``final`` or, for the instant between the two
    renames, ``final.old``, where readers look next (``complete``). A copy under ``.old`` with none under ``final`` is
    the only one left by a kill in that instant: it stays until the new one is in place."""
    old = final.with_name(final.name + OLD)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # superseded by final
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith((".tmp", OLD)))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file() and not path.name.endswith((".tmp", OLD))


def complete(path: Path) -> Path | None:
    """The complete checkpoint at ``path``, or the earlier copy a kill during its re-save left (``replace_dir``)."""
    if is_complete(path):
        return path
    old = path.with_name(path.name + OLD)
    return old if (old / TRAINER_STATE).is_file() else None


def _newest_complete(run_dir: Path) -> Path | None:
    root = checkpoints_root(run_dir)
    latest = root / "latest"
    done = sorted(p for p in root.glob("step-*") if is_complete(p))
    if latest.is_file():
        cand = complete(root / latest.read_text().strip())
        if cand is not None and (not done or cand.name >= done[-1].name):
            return cand
    return done[-1] if done else None


def find_resume_dir(resume: str, output_dir: Path) -> Path | None:
    """'auto': the newest complete checkpoint under output_dir (None if there is none); else a checkpoint, or a run
    directory (another run's output_dir, what users reach for first): its newest complete checkpoint."""
    if resume == "auto":
        return _newest_complete(output_dir)
    path = Path(resume)
    if is_complete(path):
        return path
    if checkpoints_root(path).is_dir():
        found = _newest_complete(path)
        if found is not None:
            return found
        raise UserError(f"run directory {resume!r} holds no complete checkpoint", "pass a run that saved one (--save-every N)")
    raise UserError(f"{resume!r} is not a complete shardlab checkpoint (no {TRAINER_STATE})",
                    "pass --resume auto, a run directory or a checkpoints/step-N directory")


def read_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / TRAINER_STATE).read_text())


def check_trusted(cfg, say=print) -> None:
    """Before anything reads it: the checkpoint `--resume` picks was written by shardlab for this user, or holds only
    tensors and plain data, or the user trusts it (trust.py); else one line and no run."""
    found = find_resume_dir(cfg.resume, Path(cfg.output_dir)) if cfg.resume else None
    if found is not None:
        trust.check_checkpoint(found, cfg.trust_checkpoint, f"--resume {cfg.resume}", say)


def check_resume(run) -> None:
    """Before any process starts: the checkpoint `--resume` picks can be loaded by the resolved ``run``."""
    cfg = run.cfg
    if not cfg.resume:
        return
    found = find_resume_dir(cfg.resume, Path(cfg.output_dir))
    saved = read_state(found).get("layout") if found is not None else None
    if saved:
        reshard.check_pair(saved, reshard.layout(run))


def load(strategy, directory: Path, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: restore engine state and this rank's RNG; returns the trainer state.

    `layout` describes the resuming run (reshard.layout); a checkpoint written with another
    strategy or number of ranks is converted by reshard.py where that pair is supported.
    """
    state = read_state(directory)
    saved = state.get("layout")
    if layout is not None and saved is not None:
        reshard.check_kept_settings(saved, layout)
    if layout is None or saved is None or reshard.loads_natively(saved, layout):
        strategy.load_checkpoint(directory)
    else:
        reshard.load(strategy, directory, saved, layout)
    rng_file = directory / f"rng_rank{strategy.env.rank}.pt"
    if rng_file.is_file() and (saved is None or layout is None or saved.get("world_size") == layout["world_size"]):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # numpy's key array as a tensor: the file then loads with weights_only=True
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_hf(hf_model, state: dict[str, torch.Tensor], tokenizer, final: Path, cfg=None, adapter=None) -> Path:
    """Write a `from_pretrained`-loadable directory atomically (tmp dir, then rename); its tokenizer's files too unless
    ``tokenizer`` is None (a run on synthetic data whose tokenizer is not installed: the model alone). A model with
    adapters (--peft, ``cfg`` its run's config, ``adapter`` its record: adapters.layout) is written as peft's adapter
    directory."""
    from ..training import adapters

    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if adapters.is_adapted(hf_model):
        adapters.save_adapter(hf_model, state, tmp, cfg, adapter)
    else:
        hf_model.save_pretrained(tmp, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    return replace_dir(tmp, final)


def export_hf(strategy, tokenizer, output_dir: Path) -> Path | None:
    """Collective: gather full weights and write a `from_pretrained`-loadable model directory; with --peft, gather the
    adapters only and write peft's adapter directory."""
    adapted = strategy.cfg.peft.method is not None
    state = strategy.full_state_dict(trainable_only=adapted)
    if not strategy.env.is_main:
        strategy.env.barrier()
        return None
    adapter = None
    if adapted:
        from ..training import adapters

        adapter = adapters.layout(strategy.cfg, strategy.env.device.type, strategy.precision.name)
    final = save_hf(strategy.hf_model, state, tokenizer, output_dir / EXPORT_DIR, strategy.cfg, adapter)
    strategy.env.barrier()
    return final
