"""Issue 15 (zero1/zero2 on one GPU): profile speed_gpu cells with shardlab's own `--profile` (torch profiler, CPU +
CUDA, 4 steady steps) and print, per cell, step wall time against GPU busy time and the operators that cost the most
host time and device time. Each cell's profile directory is copied to `--out/prof-<cell>/` (trace gzipped).

    python3 benchmarks/profile_cells.py --out $OUT/prof --cells dp,zero2,zero2-nocheck
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

import foundation_gpu as fg
import speed_gpu  # noqa: F401  (registers its cells in fg.CELLS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--runs", default="/tmp/shardlab-prof-runs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for label in args.cells.split(","):
        strategy, micro, extra, ref = fg.CELLS[label]
        fg.CELLS[f"{label}@prof"] = (strategy, micro, [*extra, "--profile"], ref)
        a = argparse.Namespace(**{**vars(args), "model": "gpt2-medium"})
        row = fg.run_cell(f"{label}@prof", a)
        if "summary" not in row:
            continue
        prof = Path(args.runs) / f"{label}@prof" / "profile"
        dst = out / f"prof-{label}"
        dst.mkdir(exist_ok=True)
        for f in ("steps_rank0.json", "ops_rank0.txt", "ops_rank0.json"):
            shutil.copy(prof / f, dst / f)
        with open(prof / "trace_rank0.json", "rb") as src, gzip.open(dst / "trace_rank0.json.gz", "wb", compresslevel=6) as g:
            shutil.copyfileobj(src, g)
        steps = json.loads((prof / "steps_rank0.json").read_text())
        ops = json.loads((prof / "ops_rank0.json").read_text())
        n = steps["active_steps"]
        print(f"\n=== {label}: step wall {steps['mean_step_wall_ms']:.1f} ms, GPU busy {steps['mean_device_busy_ms']:.1f} ms, "
              f"idle {steps.get('mean_device_idle_ms', float('nan')):.1f} ms (means of {n} profiled steps)", flush=True)
        print(f"--- {label}: top self-CPU operators, per step")
        for o in sorted(ops, key=lambda o: -o["self_cpu_us"])[:30]:
            print(f"  {o['self_cpu_us'] / n / 1e3:8.2f} ms cpu  {o['self_device_us'] / n / 1e3:8.2f} ms dev  {o['calls'] / n:7.0f} calls  {o['name'][:90]}")
        print(f"--- {label}: top self-device operators, per step")
        for o in sorted(ops, key=lambda o: -o["self_device_us"])[:25]:
            print(f"  {o['self_device_us'] / n / 1e3:8.2f} ms dev  {o['self_cpu_us'] / n / 1e3:8.2f} ms cpu  {o['calls'] / n:7.0f} calls  {o['name'][:90]}")
        tot_calls = sum(o["calls"] for o in ops if not o["name"].startswith("ProfilerStep")) / n
        print(f"--- {label}: {tot_calls:,.0f} profiled events a step", flush=True)


if __name__ == "__main__":
    main()
