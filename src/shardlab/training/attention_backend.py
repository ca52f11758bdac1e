"""Which kernel ``F.scaled_dot_product_attention`` runs (``sdpa_backend``).

torch tries its SDPA backends in a fixed order (flash, memory-efficient, math, cuDNN: cuDNN last) and runs the first
that accepts the inputs. On Hopper GPUs cuDNN 9's attention is a different kernel family from torch's FlashAttention-2
port; which one is faster depends on the GPU, head size and cuDNN version, so this is a choice to measure
(benchmarks/speed_gpu.py cells ``*-cudnn``), not one to hard-code.

``sdpa_backend`` moves one fused backend to the front of torch's order (``sdpa_kernel(..., set_priority=True)``) and
keeps the others behind it, so inputs the chosen kernel rejects (an additive mask under flash, say) still run; 'math'
is the unfused reference alone (torch's CPU dispatch ignores priorities and would otherwise still run flash). It is
entered around each forward: backward runs the kernel paired with the forward's, and torch.compile traces the
forward under it, so compiled graphs get the same choice. Models that do not call SDPA (``--attn-implementation
eager``) are unaffected; BLOOM's ALiBi attention (compat/bloom_sdpa.py) passes a bias, which flash rejects.

torch's AOTAutograd cache does not key on these flags: a graph compiled under one backend is loaded from the cache
under another (checked with torch 2.13: a math run after a default one got the flash graph). So each non-default
choice compiles into a cache directory of its own (``measure.compile_stats.use_persistent_cache``).
"""

from __future__ import annotations

import contextlib

from ..errors import UserError

# config value -> torch's backend name (torch.nn.attention.SDPBackend)
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
CUDA_ONLY = ("efficient", "cudnn")  # no CPU kernels: on a CPU the choice would silently do nothing


def check(choice: str, device_type: str) -> None:
    """Refuse, before any spawn, a backend this device does not have."""
    if choice in CUDA_ONLY and device_type != "cuda":
        raise UserError(f"sdpa_backend {choice!r} needs a CUDA GPU (torch has no {choice} attention kernel on a {device_type})",
                        "drop --set sdpa_backend, or use 'flash' / 'math', which CPUs have")


def priority(choice: str) -> list:
    """The SDPA backends in the order torch should try them: ``choice`` first, then torch's own order."""
    from torch.nn.attention import SDPBackend

    default = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]
    first = getattr(SDPBackend, BACKENDS[choice])
    if first == SDPBackend.MATH:
        return [first]
    return [first] + [b for b in default if b != first]


def context(choice: str):
    """Context for one forward: torch's default order under 'auto'."""
    if choice == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(priority(choice), set_priority=True)
