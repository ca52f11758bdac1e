"""`shardlab plan` against measurement: predicted vs measured peak memory over a grid, and `--micro-batch auto`.

Each cell is a fresh `shardlab train` process (clean peaks) for a few optimizer steps on random tokens;
its summary.json holds the measured peak (gpu_mem_peak_gib = torch.cuda.max_memory_allocated, the
largest rank) and, under `plan`, the prediction train made for itself before starting. The error is
predicted / measured - 1; the worst |error| is reported.

On one GPU, cells run side by side to fit the time (each process's max_memory_allocated is its own,
so sharing the GPU does not change what is measured): as many as fit in the GPU's memory by their own
prediction (x1.15 fragmentation + 1.5 GiB context/NCCL each), at most --jobs, at most two CPU-offload
cells at a time (CPU Adam threads). DeepSpeed's JIT ops (FusedAdam, CPU Adam) are built once first, while
dp/fsdp cells run. A cell that fails while sharing the GPU is re-run alone.

`--micro-batch auto` check (--auto-check MODEL:STRATEGY:SEQ): `shardlab train --micro-batch auto` finds m
by its trials, then m+1 is run in a fresh process: on a GPU it must run out of memory (exit 3), so the
search found the largest micro batch that fits (within one step). On a CPU there is no memory limit to
run into; the check shows the search and its trial only.

    # GPU (one device call; 56 cells + the auto check, estimated 8-9 min on an H100, never run yet):
    bash benchmarks/plan_validation.sh
    # if the time budget cuts it short (cells not started are listed as such), split it in two calls:
    bash benchmarks/plan_validation.sh --models gpt2,gpt2-medium --auto-check ''
    bash benchmarks/plan_validation.sh --models gpt2-large,bloom-560m
    # CPU smoke test (tests/test_plan_validation_script.py):
    python benchmarks/plan_validation.py --device cpu --models tiny-gpt2 --seqs 64 --strategies dp --micro 2 \
        --steps 2 --auto-check tiny-gpt2:dp:64 --out /tmp/pv
Writes OUT/plan_validation.json (every cell, the worst error, the auto check) and OUT/plan_validation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

GiB = 2**30
DEFAULT_MODELS = "gpt2,gpt2-medium,gpt2-large,bloom-560m"
DEFAULT_STRATEGIES = "dp,zero1,zero2,zero3,zero2_offload,zero3_offload,fsdp"
OFFLOAD = ("zero1_offload", "zero2_offload", "zero3_offload", "fsdp_offload", "infinity")
CONTEXT_GIB = 1.5  # per process beside its allocations: CUDA context, NCCL, cuBLAS workspace, slack
CELL_S = 60  # a cell's wall time on an H100 (imports, model init, engine setup, 3 steps): ~30-45 s
AUTO_S = 200  # the --micro-batch auto check: ~5-8 trials of ~20 s, the run, and micro+1


def cell_args(model: str, strategy: str, seq: int, micro: str, steps: int, device: str, run_dir: Path, extra=()) -> list[str]:
    # enough random tokens for every step (auto: for trials up to micro ~1000), plus a few eval blocks
    blocks = 3000 if micro == "auto" else int((steps + 2) * (int(micro) + 1) * 1.3)
    tokens = (blocks + 64) * seq
    args = [
        "--model", model, "--strategy", strategy, "--seq-len", str(seq), "--micro-batch", str(micro), "--max-steps", str(steps),
        "--dataset", "synthetic", "--set", f"dataset.synthetic_tokens={tokens}", "--eval-split", "0.02",
        "--set", "dataset.eval_samples=1", "--no-export", "--log-every", str(steps), "--device", device,
        "--output-dir", str(run_dir), "--overwrite",
    ]  # fmt: skip
    if device == "cuda":
        args += ["--precision", "bf16"]
    else:
        args += ["--precision", "fp32", "--dropout", "0"]
    if micro != "auto":
        args += ["--grad-accum", "1"]
    return args + list(extra)


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_train(args: list[str], timeout: float, threads: int | None = None) -> dict:
    """`python -m shardlab train ARGS` in a fresh process; its exit code, time, peak RSS (wait4) and summary."""
    out_dir = Path(args[args.index("--output-dir") + 1])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log = out_dir.parent / f"{out_dir.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "shardlab", "train", *args], stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        timer = threading.Timer(timeout, _kill_group, (proc.pid,))  # its spawned workers too
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # wait4: the child's peak RSS comes with its exit status
        except BaseException:  # interrupted: do not leave the run behind
            _kill_group(proc.pid)
            raise
        finally:
            timer.cancel()
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    row = {"rc": rc, "wall_s": round(time.time() - t0, 1), "peak_rss_gib": usage.ru_maxrss * 1024 / GiB, "log": str(log)}
    if rc == 0 and (out_dir / "summary.json").is_file():
        row["summary"] = json.loads((out_dir / "summary.json").read_text())
    else:
        row["error"] = [line for line in log.read_text().splitlines() if line.strip()][-3:]
    return row


def predicted_gib(model: str, strategy: str, seq: int, micro: int, device: str, gpu_gib: float) -> float:
    """What the scheduler packs by: the plan's own prediction (GiB per GPU)."""
    from shardlab.config import RunConfig
    from shardlab.planning.planner import plan

    if device != "cuda":
        return 0.0
    cfg = RunConfig(model=model, strategy=strategy, seq_len=seq, micro_batch=micro, grad_accum=1, precision="bf16", gpus=1)
    return plan(cfg, gpu_memory_gb=gpu_gib, strategies=(strategy,)).strategies[strategy].gpu_peak / GiB


def gpu_memory() -> tuple[float, str]:
    """GPU 0's total memory (GiB) and name, through NVML: no CUDA context in this scheduling process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        h = pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith(("GPU-", "MIG-")) else pynvml.nvmlDeviceGetHandleByIndex(int(visible))
        total, name = pynvml.nvmlDeviceGetMemoryInfo(h).total, pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
    except Exception:  # noqa: BLE001 - no NVML: ask torch (creates a context here, ~0.5 GiB on GPU 0)
        import torch

        props = torch.cuda.get_device_properties(0)
        total, name = props.total_memory, props.name
    # torch reports the memory the driver lets processes use (~79.1 of 80 GiB on an H100); NVML the whole HBM
    return total / GiB, f"{name} ({total / GiB:.1f} GiB)"


def prebuild_deepspeed_ops() -> subprocess.Popen:
    code = ("from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder\n"
            "for b in (FusedAdamBuilder(), CPUAdamBuilder()):\n"
            "    try:\n        b.load(verbose=False)\n    except Exception as e:\n        print('prebuild', type(b).__name__, e)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def run_grid(cells: list[dict], args, gpu_gib: float, on_done=lambda rows: None) -> list[dict]:
    """Run cells side by side within the GPU's memory; re-run alone the ones that failed while sharing.

    Largest predicted need first (dp/fsdp while DeepSpeed's ops build), smaller ones fill what is left."""
    budget = 0.9 * gpu_gib if args.device == "cuda" else float("inf")
    pending = sorted(cells, key=lambda c: -c["need_gib"])
    running: dict[int, tuple[dict, threading.Thread]] = {}
    done: list[dict] = []
    prebuild = prebuild_deepspeed_ops() if args.device == "cuda" and any(c["strategy"].startswith("zero") or c["strategy"] == "infinity" for c in cells) else None
    lock = threading.Lock()
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, args.jobs))  # the cores this process may use (a SLURM cpuset)

    def worker(cell: dict) -> None:
        res = run_train(cell["args"], args.timeout, threads)
        with lock:
            cell.update(res)

    t_start = time.time()
    while pending or running:
        if pending and time.time() > args.grid_deadline - CELL_S:  # it would not finish in its share of the budget
            for cell in pending:
                cell.update(rc=None, skipped="not started: the time budget (--budget-min) ran out")
            done.extend(pending)
            pending = []
        for key in [k for k, (_, th) in running.items() if not th.is_alive()]:
            cell, _ = running.pop(key)
            done.append(cell)
            on_done(done)
            print(f"[{cell['name']}] rc {cell['rc']} in {cell['wall_s']} s" + (
                f": measured {measured_of(cell):.2f} GiB, predicted {predicted_of(cell):.2f} GiB" if cell.get("summary") else ""), flush=True)
        ds_ready = prebuild is None or prebuild.poll() is not None
        in_use = sum(c["need_gib"] for c, _ in running.values())
        offload_running = sum(c["strategy"] in OFFLOAD for c, _ in running.values())
        started = False
        for cell in list(pending):
            if len(running) >= args.jobs:
                break
            if cell["strategy"].startswith("zero") and not ds_ready:
                continue
            if cell["strategy"] in OFFLOAD and offload_running >= 2:
                continue
            if running and in_use + cell["need_gib"] > budget:
                continue
            pending.remove(cell)
            cell["shared"] = bool(running)
            for other, _ in running.values():
                other["shared"] = True
            th = threading.Thread(target=worker, args=(cell,), daemon=True)
            running[id(cell)] = (cell, th)
            th.start()
            in_use += cell["need_gib"]
            offload_running += cell["strategy"] in OFFLOAD
            started = True
        if not started:
            time.sleep(0.5)
    retry = [c for c in done if c["rc"] not in (0, None) and c.get("shared")]
    for cell in retry:  # out of memory (or anything else) while sharing: measure it alone
        if time.time() > args.grid_deadline - CELL_S:
            cell["retry"] = "not re-run alone: the time budget ran out"
            continue
        print(f"[{cell['name']}] failed while sharing the GPU (rc {cell['rc']}); re-running it alone", flush=True)
        first = {k: cell.pop(k) for k in ("rc", "error", "wall_s") if k in cell}
        cell.update(run_train(cell["args"], args.timeout))
        cell["first_attempt"] = first
        cell["shared"] = False
        on_done(done)
    print(f"grid: {len(done)} cells in {time.time() - t_start:.0f} s", flush=True)
    return done


def measured_of(cell: dict) -> float | None:
    s = cell.get("summary") or {}
    if cell["device"] == "cuda":
        return s.get("gpu_mem_peak_gib")
    return cell.get("peak_rss_gib")  # the CPU run's peak RSS (one rank)


def predicted_of(cell: dict) -> float | None:
    p = (cell.get("summary") or {}).get("plan") or {}
    return p.get("gpu_peak_gib") if cell["device"] == "cuda" else p.get("cpu_gib")


def auto_check(spec: str, args, runs: Path) -> dict:
    model, strategy, seq = spec.split(":")
    seq = int(seq)
    extra = ["--cpu-memory-budget-gb", str(args.cpu_budget_gb)] if args.device == "cpu" else []
    found = run_train(cell_args(model, strategy, seq, "auto", 2, args.device, runs / "auto", extra), args.auto_timeout)
    out = {"model": model, "strategy": strategy, "seq": seq, "rc": found["rc"], "wall_s": found["wall_s"]}
    if found["rc"] != 0:
        out["error"] = found.get("error")
        return out
    auto = found["summary"]["plan"].get("micro_batch_auto", {})
    m = auto.get("chosen")
    out.update(found=m, plan_start=auto.get("plan_start"), trials=[{k: t[k] for k in ("micro", "result", "peak_gib", "seconds")}
                                                                    for t in auto.get("trials", [])],
               measured_peak_gib=measured_of({"device": args.device, **found}))
    if args.device != "cuda":
        out["next"] = "not applicable on CPU: no memory limit to run into (auto = the plan under the host-RAM budget, one trial)"
        return out
    above = run_train(cell_args(model, strategy, seq, str(m + 1), 2, args.device, runs / "auto-plus-one"), args.timeout)
    out["next"] = {"micro": m + 1, "rc": above["rc"], "out_of_memory": above["rc"] == 3, "error": above.get("error")}
    out["within_one_step"] = above["rc"] == 3
    return out


def markdown(rows: list[dict], worst: dict | None, auto: dict | None, args, gpu_name: str) -> str:
    unit = "peak allocated per GPU (GiB)" if args.device == "cuda" else "peak host memory (GiB, RSS)"
    lines = [f"# shardlab plan vs measured: {unit}", "",
             f"Device: {gpu_name}; micro batch {args.micro}, grad accum 1, {args.steps} optimizer steps per cell, "
             f"{'bf16' if args.device == 'cuda' else 'fp32'}, random tokens; each cell a fresh `shardlab train` process.", "",
             "| model | seq | strategy | predicted | measured | error | peak moment (plan) | fits (plan) | ran beside others |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        pred, meas = predicted_of(c), measured_of(c)
        if c.get("summary") is None:
            why = c.get("skipped") or f"failed (rc {c['rc']})"
            lines.append(f"| {c['model']} | {c['seq']} | {c['strategy']} | | {why} | | | | |")
            continue
        plan = c["summary"].get("plan") or {}
        err = "" if not (pred and meas) else f"{pred / meas - 1:+.1%}"
        lines.append(f"| {c['model']} | {c['seq']} | {c['strategy']} | {pred:.2f} | {meas:.2f} | {err} | "
                     f"{plan.get('peak_moment', '-')} | {plan.get('fits')} | {'yes' if c.get('shared') else 'no'} |")
    if worst:
        lines += ["", f"**Worst error: {worst['error']:+.1%}** ({worst['model']}, seq {worst['seq']}, {worst['strategy']}); "
                      f"{worst['within_10']} of {worst['cells']} cells within ±10%."]
    if auto:
        lines += ["", "## --micro-batch auto", "", "```", json.dumps(auto, indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="plan_validation.json / .md go here")
    p.add_argument("--runs", default=None, help="run directories (default: OUT/runs)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--models", default=DEFAULT_MODELS)
    p.add_argument("--seqs", default="512,1024")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per cell (the peak is reached by the second)")
    p.add_argument("--jobs", type=int, default=None, help="cells at a time (default: 5 on a GPU, 1 on CPU)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--auto-check", default="gpt2:zero2:1024", help="MODEL:STRATEGY:SEQ for --micro-batch auto ('' to skip)")
    p.add_argument("--auto-timeout", type=float, default=1500)
    p.add_argument("--cpu-budget-gb", type=float, default=2.0, help="CPU auto check: cpu_memory_budget_gb")
    p.add_argument("--budget-min", type=float, default=9.0,
                   help="wall-clock budget: no cell starts that could not finish in it, the auto check is skipped when it would not")
    args = p.parse_args(argv)
    args.jobs = args.jobs or (5 if args.device == "cuda" else 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs) if args.runs else out / "runs"
    gpu_gib, gpu_name = (gpu_memory() if args.device == "cuda" else (0.0, "CPU"))
    cells = []
    for model in args.models.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            for strategy in args.strategies.split(","):
                name = f"{model}-s{seq}-{strategy}"
                need = predicted_gib(model, strategy, seq, args.micro, args.device, gpu_gib) * 1.15 + CONTEXT_GIB
                cells.append({"name": name, "model": model, "seq": seq, "strategy": strategy, "device": args.device,
                              "need_gib": need, "args": cell_args(model, strategy, seq, str(args.micro), args.steps, args.device, runs / name)})
    t0 = time.time()
    args.deadline = t0 + 60 * args.budget_min
    args.grid_deadline = args.deadline - (AUTO_S if args.auto_check else 0)  # the auto check keeps its share

    def write(rows: list[dict], auto: dict | None = None) -> bool:
        """Results so far (a session cut off at its time limit keeps what finished)."""
        rows = sorted(rows, key=lambda c: [x["name"] for x in cells].index(c["name"]))
        errs = [(predicted_of(c) / measured_of(c) - 1, c) for c in rows if c.get("summary") and predicted_of(c) and measured_of(c)]
        worst = None
        if errs:
            e, c = max(errs, key=lambda x: abs(x[0]))
            worst = {"error": e, "model": c["model"], "seq": c["seq"], "strategy": c["strategy"], "cells": len(errs),
                     "within_10": sum(abs(x) <= 0.10 for x, _ in errs)}
        result = {"device": gpu_name, "micro": args.micro, "steps": args.steps, "wall_s": round(time.time() - t0, 1),
                  "cells_done": len(rows), "cells_planned": len(cells), "worst": worst, "auto_check": auto, "cells": []}
        for c in rows:
            row = {k: v for k, v in c.items() if k != "args"}
            row.update(predicted_gib=predicted_of(c), measured_gib=measured_of(c), command="shardlab train " + " ".join(c["args"]))
            if c.get("summary"):
                row["summary"] = {k: c["summary"].get(k) for k in ("gpu_mem_peak_gib", "gpu_mem_peak_reserved_gib", "cpu_rss_max_rank_gib",
                                                                   "micro_batch", "grad_accum", "precision", "steps", "plan")}
            result["cells"].append(row)
        (out / "plan_validation.json").write_text(json.dumps(result, indent=1))
        md = markdown(rows, worst, auto, args, gpu_name)
        (out / "plan_validation.md").write_text(md)
        return bool(rows) and all(c.get("summary") for c in rows) and len(rows) == len(cells)

    rows = run_grid(cells, args, gpu_gib, on_done=write)
    auto = None
    if args.auto_check and time.time() > args.deadline - AUTO_S:
        auto = {"skipped": f"not run: less than {AUTO_S} s of the {args.budget_min} min budget left"}
    elif args.auto_check:
        auto = auto_check(args.auto_check, args, runs)
    ok = write(rows, auto)
    print((out / "plan_validation.md").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
