"""What this machine can run, asked once before a bench starts: its GPU counts, and the models a matrix names.

A suite may ask for ``gpus: machine``: 1, 2, 4, ... up to the GPUs this machine has, and that count itself
(``machine_gpu_counts``); on a CPU device, 1 and 2 worker processes. A GPU count larger than the machine has, or a
model of a model axis that is unknown or not available offline, is refused in one line before any run starts
(``check_cells``), not found minutes into the matrix as a failed cell.

torch and transformers load here only when a check needs them (function-local imports): `shardlab bench --list`
and the matrix's expansion import nothing heavy.
"""

from __future__ import annotations

from typing import Any

from ..config import config_from_dict
from ..errors import UserError

MACHINE = "machine"  # the suite value of the gpus axis that means "this machine's GPU counts"
CPU_COUNTS = [1, 2]  # on a CPU device, "GPUs" are gloo worker processes


def visible_gpus() -> int:
    """CUDA GPUs this process sees (0 without CUDA). Counting does not create a CUDA context."""
    import torch  # only when a cell may run on a GPU

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_of(config: dict[str, Any]) -> str:
    """'cuda' or 'cpu': what a cell's ``device`` resolves to on this machine, as the run will resolve it."""
    device = config.get("device", "auto")
    if device == "auto":
        return "cuda" if visible_gpus() else "cpu"
    return device


def machine_gpu_counts(device: str) -> list[int]:
    """Powers of two up to the GPUs this machine has, and that count: 1, 2, 4, 8 on 8 GPUs; 1, 2, 3 on 3."""
    if device == "cpu":
        return list(CPU_COUNTS)
    n = visible_gpus()
    if n == 0:
        raise UserError("the suite runs on CUDA GPUs but this machine has none",
                        "run it on a GPU machine, or on CPU processes: --device cpu --models tiny-gpt2 --precision fp32")
    counts, k = [], 1
    while k < n:
        counts.append(k)
        k *= 2
    return counts + [n]


def check_cells(cells, check_models: bool = True) -> None:
    """Refuse in one line what no cell could run on this machine: a GPU count above the machine's (cells on a CUDA
    device; on a CPU any number of worker processes may run) and, with ``check_models``, a model of a model axis that
    is unknown or unavailable offline (or shorter than the cell's seq_len). Models that an explicit cell sets are left
    to the run, which records why it failed."""
    needs_gpu = [c for c in cells if device_of(c.config) == "cuda"]
    if needs_gpu:
        have = visible_gpus()
        if have == 0:
            raise UserError("device cuda but this machine has no CUDA GPU",
                            "run on a GPU machine, or pass --device cpu (and a small model, e.g. --models tiny-gpt2)")
        # gpus is per node; on several nodes the others are not this machine's to count
        over = sorted({c.config.get("gpus") for c in needs_gpu
                       if (c.config.get("nodes") or 1) == 1 and (c.config.get("gpus") or 0) > have})
        if over:
            raise UserError(f"GPU count {', '.join(map(str, over))} but this machine has {have} GPU{'s' if have != 1 else ''}",
                            f"use --gpu-counts with counts of at most {have}, e.g. --gpu-counts {','.join(map(str, machine_gpu_counts('cuda')))}")
    if not check_models:
        return
    seen: set[tuple] = set()
    for c in cells:
        if "model" not in c.axis_keys:
            continue
        key = (c.config.get("model"), c.config.get("seq_len"), c.config.get("trust_remote_code"))
        if key in seen:
            continue
        seen.add(key)
        from ..training.models import build_hf_config  # torch and transformers: only when a model axis is checked

        try:
            build_hf_config(config_from_dict(c.config))  # unknown, offline-unavailable, or seq_len above its positions
        except UserError as err:  # the bench's flag is --models
            raise UserError(err.message, err.hint.replace("--model ", "--models ") if err.hint else err.hint) from None


__all__ = ["MACHINE", "visible_gpus", "device_of", "machine_gpu_counts", "check_cells"]
