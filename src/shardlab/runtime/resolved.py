"""A run as it will execute: the config and what this machine makes of it (device, precision, processes, layout,
batch), decided once by ``resolve_run`` and read by everything after it.

The launching process resolves (launch.launcher.preflight); the planner, the trainer and summary.json read the result.
Spawned ranks receive it as a record beside their config (``record`` / ``from_record``) instead of deciding again, so
a rank can never see another device, precision or batch than the launcher planned for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import RunConfig
from ..errors import UserError
from ..layout import ParallelLayout
from ..specs.registry import StrategySpec, spec
from .distributed import launched_world_size, pick_device_type, processes_per_node


@dataclass(frozen=True)
class Precision:
    name: str  # "bf16" | "fp16" | "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.name]

    @property
    def is_mixed(self) -> bool:
        return self.name != "fp32"


def resolve_precision(requested: str, device_type: str, bf16_supported: bool | None = None) -> Precision:
    """'auto' is bf16 on GPUs that have it, else fp16 on older GPUs, and fp32 on CPU.

    CPU defaults to fp32 because CPU bf16 matmuls are slow on most machines and
    fp16 autocast is not a CPU training mode.
    """
    if device_type == "cuda" and bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    if requested == "auto":
        if device_type == "cuda":
            return Precision("bf16" if bf16_supported else "fp16")
        return Precision("fp32")
    if requested == "bf16" and device_type == "cuda" and not bf16_supported:
        raise UserError(
            "bf16 requested but this GPU does not support bfloat16 (it needs compute capability 8.0+, e.g. A100/H100)",
            "use --precision fp16 (dynamic loss scaling) or --precision fp32",
        )
    if requested == "fp16" and device_type == "cpu":
        raise UserError("fp16 training is not supported on CPU", "use --precision fp32 or bf16 on CPU")
    return Precision(requested)


@dataclass(frozen=True)
class ResolvedRun:
    cfg: RunConfig
    device_type: str  # "cuda" | "cpu"
    precision: Precision
    nproc: int  # processes on this node
    world: int  # processes in the job
    layout: ParallelLayout
    # The batch triple; None while the micro batch is 'auto' (the launcher's trial search decides it: with_config)
    micro: int | None
    accum: int | None
    global_batch: int | None

    @property
    def spec(self) -> StrategySpec:
        return spec(self.cfg.strategy)

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    def with_config(self, cfg: RunConfig) -> ResolvedRun:
        """The same machine's decisions for a config that settled what was left open (the micro batch 'auto' found)."""
        return _resolve(cfg, self.device_type, self.precision, self.nproc, self.world)

    def record(self) -> dict[str, Any]:
        """What a spawned rank needs besides its config: every decision, as JSON data."""
        return {"device_type": self.device_type, "precision": self.precision.name, "nproc": self.nproc, "world": self.world,
                "layout": dataclasses.asdict(self.layout), "micro": self.micro, "accum": self.accum,
                "global_batch": self.global_batch}

    @classmethod
    def from_record(cls, cfg: RunConfig, record: dict[str, Any]) -> ResolvedRun:
        return cls(cfg=cfg, device_type=record["device_type"], precision=Precision(record["precision"]), nproc=record["nproc"],
                   world=record["world"], layout=ParallelLayout(**record["layout"]), micro=record["micro"],
                   accum=record["accum"], global_batch=record["global_batch"])


def resolve_run(cfg: RunConfig, layers: int | None = None,
                explain: Callable[[RunConfig, UserError], UserError] | None = None, device_type: str | None = None) -> ResolvedRun:
    """``cfg`` on this machine: the device it runs on, its precision (refused where the device cannot), the processes
    per node and in the job (torchrun's or srun's when they started this one), the dp x pipeline layout (``layers``:
    the model's decoder blocks, where known, so a pipeline of more stages than blocks is refused) and the batch.
    ``explain``: rewords a layout or batch refusal (one of sizes a user's DeepSpeed JSON set is told as the JSON's).
    ``device_type``: the device the caller picked already (pick_device_type) to settle the config's engine JSON."""
    device_type = device_type or pick_device_type(cfg.device)
    precision = resolve_precision(cfg.precision, device_type)
    nproc = processes_per_node(cfg, device_type)
    world = job_world(cfg, device_type)
    try:
        return _resolve(cfg, device_type, precision, nproc, world, layers)
    except UserError as err:
        if explain is None:
            raise
        raise explain(cfg, err) from None


def job_world(cfg: RunConfig, device_type: str) -> int:
    """Processes in the job: torchrun's or srun's world when they started this process, else per node x nodes."""
    return launched_world_size() or processes_per_node(cfg, device_type) * cfg.nodes


def assumed_run(cfg: RunConfig, device_type: str, world: int = 1, accum: int | None = None) -> ResolvedRun:
    """The run ``cfg`` would be on a machine this process is not on (``device_type``, ``world`` ranks; a GPU assumed to
    have bf16), for checks and plans made elsewhere than on the machine; ``accum``: the accumulation to assume."""
    precision = resolve_precision(cfg.precision, device_type, bf16_supported=True if device_type == "cuda" else None)
    layout = ParallelLayout.from_config(cfg, world, check_schedule=False)
    if accum is None and cfg.micro_batch != "auto":
        micro, accum, glob = cfg.resolve_batch(layout.dp_size)
    else:
        micro = None if cfg.micro_batch == "auto" else cfg.micro_batch
        glob = None if micro is None else micro * (accum or 1) * layout.dp_size
    return ResolvedRun(cfg, device_type, precision, max(1, world // cfg.nodes), world, layout, micro, accum, glob)


def _resolve(cfg: RunConfig, device_type: str, precision: Precision, nproc: int, world: int,
             layers: int | None = None) -> ResolvedRun:
    layout = ParallelLayout.from_config(cfg, world, layers=layers)
    micro = accum = glob = None
    if cfg.micro_batch != "auto":
        micro, accum, glob = cfg.resolve_batch(layout.dp_size)
    return ResolvedRun(cfg, device_type, precision, nproc, world, layout, micro, accum, glob)


__all__ = ["Precision", "resolve_precision", "ResolvedRun", "resolve_run", "assumed_run", "job_world"]
