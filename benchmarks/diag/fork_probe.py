"""Can a GPU run's ranks be forked from the launcher, as CPU runs' are (launch/launcher.worker_start_method)?

Runs the launcher's own path up to the spawn (`shardlab train` with --nodes 2 on this one-GPU machine, so that it
spawns), says whether that path set up CUDA in the launcher (and where it first did) and how the ranks would start,
then spawns one real rank of a one-GPU run of the same config through the launcher's own `spawn` (elastic agent,
forked_main when forked) and reads its summary.json. Last, NVML's memory total against torch's.

    python3 benchmarks/diag/fork_probe.py [STRATEGY ...]     # default: fsdp zero3
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# Who sets CUDA up in the launcher: the stack of torch's first lazy initialisation, printed with the verdict.
_first_init: list[str] = []
_lazy_init = torch.cuda._lazy_init


def _recording_lazy_init():
    if not _first_init and not torch.cuda.is_initialized():
        import traceback

        _first_init.append("".join(line for line in traceback.format_stack()[:-1] if "importlib" not in line)[-4000:])
    return _lazy_init()


for _module in list(sys.modules.values()):  # torch's own modules hold the function by name too
    if getattr(_module, "_lazy_init", None) is _lazy_init:
        _module._lazy_init = _recording_lazy_init

MODEL = "llama-3.2-1b" if torch.cuda.is_available() else "tiny-gpt2"  # a CPU run checks the probe itself


def probe(strategy: str) -> None:
    import shardlab.launch.launcher as launcher
    from shardlab.config import load_config

    real_spawn = launcher.spawn

    def spawn_one_rank(run, plan=None) -> None:
        how = launcher.worker_start_method(run.device_type)
        print(f"probe {strategy}: launcher path done; CUDA set up in the launcher: {torch.cuda.is_initialized()}; "
              f"ranks would start as: {how}", flush=True)
        if _first_init:
            print(f"probe: CUDA was first set up here:\n{_first_init[0]}", flush=True)
        one = launcher.preflight(run.cfg.model_copy(update={"nodes": 1, "gpus": 1}), run.device_type)
        start = time.perf_counter()
        real_spawn(one, plan=None)
        summary = json.loads((Path(one.cfg.output_dir) / "summary.json").read_text())
        print(f"probe {strategy}: one {how} rank trained in {time.perf_counter() - start:.1f} s: final loss "
              f"{summary.get('final_train_loss')}, start-up {summary.get('startup_s')}", flush=True)

    launcher.spawn = spawn_one_rank
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(overrides={"model": MODEL, "seq_len": 512, "precision": "bf16", "micro_batch": 4,
                                         "max_steps": 6, "strategy": strategy, "nodes": 2, "export": False,
                                         "output_dir": f"{tmp}/run"},
                              sets={"dataset.source": "synthetic", "dataset.eval_split": 0})
            launcher.train(cfg, force=True)
    finally:
        launcher.spawn = real_spawn


def main() -> None:
    for strategy in sys.argv[1:] or ["fsdp", "zero3"]:
        probe(strategy)
    if not torch.cuda.is_available():
        return
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(f"probe: memory total, NVML {pynvml.nvmlDeviceGetMemoryInfo(handle).total} B, torch "
          f"{torch.cuda.get_device_properties(0).total_memory} B; capability NVML "
          f"{pynvml.nvmlDeviceGetCudaComputeCapability(handle)}, torch {torch.cuda.get_device_capability(0)}", flush=True)


if __name__ == "__main__":
    main()
