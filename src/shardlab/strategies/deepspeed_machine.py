"""What a DeepSpeed run needs of the machine it runs on, checked or prepared before the engine starts: a ZeRO-Infinity
swap directory that is writable and has room, a TORCH_CUDA_ARCH_LIST that DeepSpeed's op builder can parse, and a
notice for each op DeepSpeed is about to JIT-compile.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..specs.deepspeed_zero import NVME_BYTES_PER_PARAM

# Lazy imports below: deepspeed and torch's extension builder load only when the ops to compile are looked up.


def check_nvme_path(path: str | None, n_params: int, extra_gb: float = 0.0) -> Path:
    """ZeRO-Infinity swap directory: must exist (or be creatable), be writable and have room."""
    if not path:
        raise UserError("strategy 'infinity' needs an NVMe directory", "pass strategy_options.nvme_path (or --nvme-path /local/nvme/dir)")
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".shardlab-write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"NVMe path {path!r} is not writable ({exc.strerror})", "point nvme_path at a writable local disk, e.g. /local/scratch/$USER") from None
    need = n_params * NVME_BYTES_PER_PARAM + extra_gb * 2**30
    free = shutil.disk_usage(p).free
    if free < need:
        raise UserError(
            f"NVMe path {path!r} has {free / 2**30:.1f} GiB free but ZeRO-Infinity needs about {need / 2**30:.1f} GiB",
            "free space there or choose a larger disk",
        )
    return p


def sanitize_cuda_arch_list(log=print) -> None:
    """DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as ints; '9.0a' (set by some images) crashes it."""
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not raw:
        return
    parts = raw.replace(";", " ").replace(",", " ").split()
    clean = []
    for part in parts:
        ptx = part.endswith("+PTX")
        base = part[:-4] if ptx else part
        base = base.rstrip("abf") if "." in base else base
        clean.append(base + ("+PTX" if ptx else ""))
    fixed = " ".join(dict.fromkeys(clean))
    if fixed != raw:
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
        log(f"TORCH_CUDA_ARCH_LIST={raw!r} cannot be parsed by DeepSpeed's op builder; using {fixed!r}")


def op_builders(ds: dict[str, Any]) -> list[str]:
    """The DeepSpeed op builders `deepspeed.initialize` loads for this JSON (each JIT-compiled unless prebuilt).

    As DeepSpeed's engine chooses: Adam/AdamW runs as CPU-Adam when ZeRO offloads the optimizer, else as
    FusedAdam (unless ``torch_adam``); NVMe offload swaps through async_io; the CPU accelerator's
    collectives use its shared-memory op (other accelerators have no such builder)."""
    zero = ds.get("zero_optimization", {})
    offloads = [zero.get(k, {}).get("device") for k in ("offload_optimizer", "offload_param")]
    out = []
    opt = ds.get("optimizer") or {}
    if str(opt.get("type", "")).lower() in ("adam", "adamw") and not (opt.get("params") or {}).get("torch_adam"):
        out.append("CPUAdamBuilder" if offloads[0] in ("cpu", "nvme") else "FusedAdamBuilder")
    if "nvme" in offloads:
        out.append("AsyncIOBuilder")
    out.append("ShareMemCommBuilder")
    return out


def unbuilt_ops(builder_names: list[str]) -> list[tuple[str, str]]:
    """(op name, build directory) of the ops DeepSpeed will compile now: neither prebuilt at install time
    (DS_BUILD_*) nor in torch's extension cache (TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions) yet."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory  # where torch's `load` (DeepSpeed's jit_load) builds

    out = []
    for name in builder_names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or installed_ops.get(builder.name) or not builder.is_compatible(verbose=False):
            continue
        build_dir = _get_build_directory(builder.name, False)
        if not (Path(build_dir) / f"{builder.name}.so").is_file():
            out.append((builder.name, build_dir))
    return out


def announce_op_builds(ds: dict[str, Any], log) -> None:
    """Say so before DeepSpeed compiles an op: the first build is minutes of silence otherwise."""
    try:
        todo = unbuilt_ops(op_builders(ds))
    except Exception as err:  # noqa: BLE001 - a DeepSpeed or torch internal moved: the notice is not worth a failed run
        log(f"(could not tell whether DeepSpeed must compile ops first: {type(err).__name__}: {err})")
        return
    for name, build_dir in todo:
        log(f"DeepSpeed compiles its {name} op now: the first build on this machine takes minutes (cached in {build_dir} afterwards)")
