"""What a run tells the user and records about where it ran: rank 0's messages, the progress bar or its plain-line
form in a log file, env.json's environment, and the summary table printed at the end of a run."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys
import time
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from .. import messages
from ..measure import mfu
from ..runtime.distributed import DistEnv, physical_cores
from ..runtime.resolved import Precision


def log0(env: DistEnv, *msg: Any) -> None:
    """A message from rank 0 only: every rank runs the same loop, and one copy of each line is enough."""
    if env.is_main:
        messages.info(" ".join(str(m) for m in msg))


def progress_bar(env: DistEnv, total: int, done: int):
    """Rank 0's progress bar over the run's optimizer steps, starting at ``done`` (a resumed run); None elsewhere."""
    if not env.is_main:
        return None
    # disable=None: tqdm draws only when its stream (stderr) is a terminal
    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True, disable=None)


def progress_line(row: dict[str, Any], total_steps: int, eta_s: float) -> str:
    """One metrics row as a plain log line: what the progress bar shows on a terminal, for a log file."""
    memory = (f"GPU mem {row['gpu_mem_alloc_gib']:.2f} GiB (peak {row['gpu_mem_peak_gib']:.2f})" if "gpu_mem_alloc_gib" in row
              else f"host RSS {row['cpu_rss_gib']:.2f} GiB (rank 0)")
    eta = time.strftime("%H:%M:%S", time.gmtime(eta_s)) if eta_s < 86400 else f"{eta_s / 86400:.1f} days"
    return (f"[shardlab] step {row['step']}/{total_steps} | epoch {row['epoch']:.3f} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"{row['tokens_per_s']:,.0f} tokens/s | step {row['step_time_s']:.3f} s | {memory} | ETA {eta}")


def environment_info(env: DistEnv, precision: Precision) -> dict[str, Any]:
    """env.json: the host, library versions, world and GPUs a run ran on."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "world_size": env.world_size,
        "backend": env.backend,
        "device_type": env.device.type,
        "precision": precision.name,
        "argv": sys.argv,
        "cpus": cpu_topology(),
    }
    for pkg in ("deepspeed", "datasets"):
        # The installed version from the package metadata, not `import pkg`: importing datasets (pandas, pyarrow)
        # and deepspeed (its op builders) cost a dp run on local data seconds before its first step.
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:  # absent optional engine: just not recorded
            info[pkg] = None
    if env.device.type == "cuda":
        info["gpus"] = [
            {"name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
             "memory_gib": torch.cuda.get_device_properties(i).total_memory / 2**30}
            for i in range(torch.cuda.device_count())
        ]
    return info


def cpu_topology() -> dict[str, Any]:
    """The CPUs this process may run on, logical and physical (SMT siblings grouped): what the thread pin and the rank
    shares are cut from, and what a host-bound run's speed follows."""
    logical = sorted(os.sched_getaffinity(0))
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:  # not Linux: the model is not recorded
        pass
    return {"logical": len(logical), "physical": len(physical_cores(logical)), "model": model}


def print_summary(summary: dict[str, Any]) -> None:
    """The summary's headline figures as a table on the terminal (rank 0, unless --quiet)."""
    table = Table(title=f"shardlab run: {summary['model']} / {summary['strategy']} / {summary['precision']}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    for key in ("world_size", "global_batch", "seq_len", "steps", "final_train_loss", "initial_eval_loss", "final_eval_loss",
                "final_eval_ppl", "best_eval_loss", "best_step",
                "tokens_per_s", "useful_tokens_per_s", "samples_per_s", "step_time_median_s", "warmup_steps_excluded",
                "gpu_mem_peak_gib", "gpu_mem_peak_reserved_gib", "cpu_rss_max_rank_gib", "cpu_rss_peak_rank_gib",
                "time_to_first_step_s", "compile_time_s", "total_time_s"):
        if summary.get(key) is not None:
            table.add_row(key, fmt(summary[key]))
    adapter = summary.get("adapter")
    if adapter:
        table.add_row(f"trainable parameters ({adapter['method']} r {adapter['r']})",
                      f"{adapter['trainable_params']:,} of {adapter['total_params']:,} ({adapter['trainable_fraction']:.2%})")
    if summary.get("mfu") is not None:
        table.add_row("MFU (useful tokens)", f"{summary['mfu']:.1%} of {summary['peak_tflops_per_device']:,.0f} TFLOP/s ({summary['peak_math_mode']}); "
                      f"counts {summary.get('flops_counted') or mfu.FULL_COUNT}")
    elif summary.get("mfu_note"):
        table.add_row("MFU", summary["mfu_note"].removeprefix("MFU not reported: "))
    if summary.get("model_tflops_per_s") is not None:
        table.add_row("model TFLOP/s (useful tokens, all devices)", fmt(summary["model_tflops_per_s"]))
    if summary.get("stopped_early"):
        table.add_row("stopped early: evaluations without a new best", str(summary["early_stopping_patience"]))
    pp = summary.get("pipeline")
    if pp:
        table.add_row("pipeline step ms: measured / simulated", f"{pp['measured_step_ms']:.4g} / {pp['simulated_step_ms']:.4g}")
        table.add_row("pipeline bubble: measured / simulated", f"{pp['measured_bubble']:.1%} / {pp['simulated_bubble']:.1%}")
    Console().print(table)
