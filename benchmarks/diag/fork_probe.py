"""Can a GPU run's ranks be forked from the launcher, as CPU runs' are (launch/launcher.worker_start_method)?

Runs the launcher's own path up to the spawn (`shardlab train` with --nodes 2 on this one-GPU machine, the spawn
replaced), says whether that path initialised CUDA in the launcher, then forks one child that sets up CUDA and a
one-rank NCCL group and all-reduces, as a forked rank would. Also times what an exec'd rank spends importing.

    python3 benchmarks/diag/fork_probe.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import torch


def child(queue, port: int) -> None:
    try:
        import torch.distributed as dist

        start = time.perf_counter()
        x = torch.randn(1024, 1024, device="cuda")
        value = float((x @ x).sum())
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        queue.put(("ok", value, time.perf_counter() - start))
    except Exception as err:  # noqa: BLE001 - the probe reports any failure
        queue.put(("failed", repr(err)[:400], None))


def fake_spawn(run, plan=None) -> None:
    from shardlab.runtime.distributed import free_port

    print(f"probe: launcher path done; torch.cuda.is_initialized() in the launcher: {torch.cuda.is_initialized()}", flush=True)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue, free_port()))
    start = time.perf_counter()
    proc.start()
    print("probe: forked child:", queue.get(timeout=180), f"({time.perf_counter() - start:.1f} s)", flush=True)
    proc.join()


def main() -> None:
    import shardlab.launch.launcher as launcher
    from shardlab.config import load_config

    launcher.spawn = fake_spawn
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(overrides={"model": "llama-3.2-1b", "seq_len": 1024, "precision": "bf16", "micro_batch": 8,
                                     "strategy": sys.argv[1] if len(sys.argv) > 1 else "fsdp", "nodes": 2, "export": False,
                                     "output_dir": f"{tmp}/run"},
                          sets={"dataset.source": "synthetic", "dataset.eval_split": 0})
        launcher.train(cfg, force=True)
    for what in ("import torch", "import torch, transformers, deepspeed, shardlab.loop.trainer; from transformers import LlamaForCausalLM"):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", what], check=True, capture_output=True)
        print(f"probe: a fresh interpreter's `{what}`: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
