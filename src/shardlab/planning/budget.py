"""What a plan must fit, and whether a prediction does: memory per GPU (given, or GPU 0's as torch reports it), host RAM
and free NVMe per node (``Budget``). A GPU's usable memory is its total less the CUDA context; a prediction fits with
memory.py's fragmentation allowance and host headroom, and ``limiting_memory`` reads back which memory it ran out of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import RunConfig
from ..errors import UserError
from ..specs.registry import spec
from .memory import CUDA_CONTEXT_BYTES, HOST_HEADROOM, RESERVED_OVER_ALLOCATED, GiB, StrategyPlan, host_fits


def usable(gpu_memory: float) -> float:
    return gpu_memory - CUDA_CONTEXT_BYTES


def _fits(sp: StrategyPlan, gpu_memory: float, host_ram: float | None, nvme_free: float | None) -> tuple[bool, str]:
    need = sp.gpu_peak * RESERVED_OVER_ALLOCATED
    if need > usable(gpu_memory):
        return False, f"GPU needs {need / GiB:.1f} GiB (peak {sp.gpu_peak / GiB:.1f} + fragmentation) of {usable(gpu_memory) / GiB:.1f} usable"
    if host_ram is not None and not host_fits(sp.cpu_per_node, host_ram):
        return False, (f"CPU needs {sp.cpu_per_node / GiB:.1f} GiB (+{HOST_HEADROOM - 1:.0%} for the OS and the prediction's "
                       f"error) of {host_ram / GiB:.1f} GiB host RAM")
    nvme = spec(sp.strategy).offload_params == "nvme"
    if nvme and nvme_free is not None and sp.nvme_per_node > nvme_free:
        return False, f"NVMe needs {sp.nvme_per_node / GiB:.1f} GiB of {nvme_free / GiB:.1f} GiB free"
    if nvme and nvme_free is None:
        return True, f"GPU peak {sp.gpu_peak / GiB:.1f} GiB; needs {sp.nvme_per_node / GiB:.1f} GiB NVMe (free space not given)"
    return True, f"GPU peak {sp.gpu_peak / GiB:.1f} GiB, headroom {(usable(gpu_memory) - need) / GiB:.1f} GiB"


def detect_gpu_memory(cfg_device: str) -> float | None:
    try:
        if cfg_device != "cpu" and torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        return None
    return None


@dataclass(frozen=True)
class Budget:
    """What a plan must fit: memory per GPU, and host RAM and free NVMe per node (None: not given), in bytes."""
    gpu: float
    host: float | None = None
    nvme: float | None = None

    def fits(self, sp: StrategyPlan) -> tuple[bool, str]:
        return _fits(sp, self.gpu, self.host, self.nvme)

    def gpu_fits(self, sp: StrategyPlan) -> bool:
        return sp.gpu_peak * RESERVED_OVER_ALLOCATED <= usable(self.gpu)


def budget_for(cfg: RunConfig, gpu_memory_gb: float | None, host_ram_gb: float | None,
               nvme_free_gb: float | None) -> tuple[Budget, str]:
    """The memory given, or the GPU's detected (with where its figure came from)."""
    if gpu_memory_gb is not None:
        gpu_memory, source = gpu_memory_gb * GiB, "given"
    else:
        detected = detect_gpu_memory(cfg.device)
        if detected is None:
            raise UserError("no CUDA GPU visible to read its memory from",
                            "pass --gpu-memory-gb (e.g. 80 for an H100 80GB), or --device cpu to plan a run on this machine's CPU")
        gpu_memory, source = detected, "detected (GPU 0)"
    host = host_ram_gb * GiB if host_ram_gb is not None else None
    nvme = nvme_free_gb * GiB if nvme_free_gb is not None else None
    return Budget(gpu_memory, host, nvme), source


def limiting_memory(sp: StrategyPlan) -> str:
    """Which memory a strategy that does not fit runs out of (``_fits``'s reason)."""
    if sp.why.startswith("CPU needs"):
        return "host RAM"
    return "NVMe" if sp.why.startswith("NVMe") else "GPU"
