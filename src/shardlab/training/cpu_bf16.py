"""bf16 on a CPU is fast only where the CPU multiplies bf16 matrices itself (AVX512-BF16 or AMX on x86, the BF16
extension on Arm); elsewhere every bf16 matmul is converted and emulated, and a training step ran 14-25x slower than
in fp32 on such CPUs. A run that chose bf16 there is told so once, at its start."""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flags (x86 "flags", Arm "Features") of a native bf16 matrix multiply.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies bf16 natively; None when it cannot be told (no /proc/cpuinfo)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return bool(NATIVE_BF16_FLAGS & set(value.split()))
    return None


def slow_bf16_note(precision: str, device_type: str) -> str | None:
    if precision != "bf16" or device_type != "cpu" or native_bf16() is not False:
        return None
    return ("precision bf16 on a CPU without native bf16 matrix multiplies (no avx512_bf16/amx_bf16 flag): each step "
            "runs about 14-25x slower than in fp32 here; --precision fp32 trains faster on this machine")
