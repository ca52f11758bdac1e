"""The table of a gpu_cells.sh call, read from each run's own summary.json (one row per run directory).

    python3 benchmarks/cells_table.py BENCH_DIR   # a `shardlab bench` directory: one row per repeat, runs/LABEL/rK
    python3 benchmarks/cells_table.py DIR         # any directory of run directories
"""

import json
import sys
from pathlib import Path

from shardlab.measure.compile_stats import compared_with_cached_plan


def row(run: Path, name: str) -> str:
    path = run / "summary.json"
    if not path.exists():
        return f"| {name} | did not finish (see its log) |" + " |" * 11
    s = json.loads(path.read_text())
    plan = s.get("plan") or {}
    cpu = s.get("cpu_monitor") or {}
    split = s.get("time_split") or {}
    # a --compile run that found every graph in inductor's cache: the plan's figure for that (its workers compiled nothing)
    cached = compared_with_cached_plan(plan.get("cpu_gib_cached"), s.get("compile_cache"))
    host_plan = f"{plan['cpu_gib_cached']:.1f} cached" if cached else f"{plan.get('cpu_gib') or 0:.1f}"
    cells = [
        name, s.get("strategy"), s.get("optimizer") or "", f"{s.get('micro_batch')} x {s.get('grad_accum')}",
        f"{s.get('tokens_per_step') or 0:,}", f"{s.get('useful_tokens_per_s') or 0:,.0f}",
        f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "-",
        f"{s.get('gpu_mem_peak_gib') or 0:.2f} / {plan.get('gpu_peak_gib') or 0:.2f}",
        f"{((cpu.get('real_mb') or {}).get('peak') or 0) * 1e6 / 2**30:.1f} (rank {s.get('cpu_rss_peak_rank_gib') or 0:.1f}) / {host_plan}",
        f"{s.get('final_train_loss') or 0:.3f}", f"{s.get('step_time_median_s') or 0:.2f}",
        f"{s.get('time_to_first_step_s') or 0:.0f}",
        (f"gpu {split.get('gpu_compute_s', 0):.2f} / cpu-opt {split.get('cpu_optimizer_s', 0):.2f} / idle "
         f"{split.get('idle_s', 0):.2f}") if split else "",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


root = Path(sys.argv[1])
print("| cell | strategy | optimizer | micro x accum | tokens/step | useful tok/s | MFU | GPU peak GiB meas / plan "
      "| host GiB meas / plan | loss | step s | first step s | time split s |")
print("|" + "---|" * 13)
if (root / "bench.json").is_file():
    for entry in json.loads((root / "bench.json").read_text())["cells"]:
        for rec in entry["repeats"]:
            if rec.get("run_dir"):
                name = entry["label"] + (f" r{rec['repeat']}" if entry.get("repeats_planned", 1) > 1 else "")
                print(row(root / rec["run_dir"], name))
else:
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        print(row(run, run.name))
