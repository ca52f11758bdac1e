#!/usr/bin/env python3
"""Pipeline schedules side by side, from finished run directories (never re-trained): for each run the schedule,
its split and placement, tokens/s, the measured step time and bubble beside `shardlab pipeline simulate`'s (fed the
run's own per-virtual-stage forward / backward times, and under zbv each stage's weight-gradient share), and the
worst GPU's peak memory measured beside `shardlab plan`'s.

    python3 benchmarks/pipeline_schedules.py RUN_DIR... [--out page.md] [--json rows.json]

A directory without summary.json is named as not finished; several runs of one label (repeats) are listed each. A
`shardlab bench` run directory (BENCH_DIR/runs/LABEL/rK) is named by its cell's label, with rK when it has repeats.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_runs import run_name  # a bench's runs/LABEL/rK is named LABEL (rK with repeats)


def load(run_dir: Path) -> dict | None:
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    pp = s.get("pipeline") or {}
    plan = s.get("plan") or {}
    return {
        "run": run_name(run_dir), "model": s["model"], "gpus": s["world_size"], "precision": s["precision"], "seq_len": s["seq_len"],
        "global_batch": s["global_batch"], "micro_batch": s["micro_batch"], "tokens_per_s": s.get("tokens_per_s"),
        "final_loss": s.get("final_train_loss"), "peak_gib": s.get("gpu_mem_peak_gib"), "planned_gib": plan.get("gpu_peak_gib"),
        "schedule": pp.get("schedule"), "microbatches": pp.get("microbatches"), "split": pp.get("split"),
        "stages_of_rank": pp.get("stages_of_rank"), "measured_step_ms": pp.get("measured_step_ms"),
        "simulated_step_ms": pp.get("simulated_step_ms"), "measured_bubble": pp.get("measured_bubble"),
        "simulated_bubble": pp.get("simulated_bubble"), "virtual_stage_fwd_ms": pp.get("virtual_stage_fwd_ms"),
        "virtual_stage_bwd_ms": pp.get("virtual_stage_bwd_ms"), "virtual_stage_wgrad_ms": pp.get("virtual_stage_wgrad_ms"),
    }


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def page(rows: list[dict], missing: list[str]) -> str:
    ref = rows[0]
    out = ["# Pipeline schedules, measured beside the simulator and the planner", "",
           f"{ref['model']}, {ref['precision']}, seq {ref['seq_len']}, global batch {ref['global_batch']} sequences "
           f"(micro {ref['micro_batch']}), {ref['gpus']} GPUs.", "",
           "| run | schedule (M) | tok/s | step ms measured / simulated | bubble measured / simulated | peak GiB measured / planned | final loss |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['schedule']} ({r['microbatches']}) | {_f(r['tokens_per_s'], ',.0f')} | "
                   f"{_f(r['measured_step_ms'], '.0f')} / {_f(r['simulated_step_ms'], '.0f')} | "
                   f"{_f(r['measured_bubble'], '.1%')} / {_f(r['simulated_bubble'], '.1%')} | "
                   f"{_f(r['peak_gib'], '.1f')} / {_f(r['planned_gib'], '.1f')} | {_f(r['final_loss'], '.3f')} |")
    out += ["", "## Split and per-virtual-stage times (ms per micro-batch)", "",
            "| run | blocks per virtual stage | stages per GPU | forward | backward | of which W (zbv) |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms = lambda xs: ", ".join(f"{x:.1f}" for x in xs) if xs else ""  # noqa: E731
        split = ", ".join(f"{a}-{b}" for a, b in r["split"] or [])
        out.append(f"| {r['run']} | {split} | {r['stages_of_rank']} | {ms(r['virtual_stage_fwd_ms'])} | {ms(r['virtual_stage_bwd_ms'])} | "
                   f"{ms(r['virtual_stage_wgrad_ms'])} |")
    out += ["", "Simulated: `shardlab pipeline simulate` fed these per-virtual-stage times, no communication cost. Measured: "
            "the wall time of the schedule's step (p2p and waits included) from the first stage's GPU starting it to the last "
            "GPU ending it, warm-up steps excluded; measured bubble = 1 - busy / (GPUs x step). Planned: `shardlab plan`'s worst-GPU peak (allocated) for the run's config."]
    out += [f"\nNot finished (no summary.json): {d}" for d in missing]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [r for r in (load(Path(d)) for d in args.runs) if r is not None]
    missing = [d for d in args.runs if not (Path(d) / "summary.json").is_file()]
    if not rows:
        print("error: none of the run directories has a summary.json (fix: pass finished runs)", file=sys.stderr)
        return 2
    text = page(rows, missing)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
