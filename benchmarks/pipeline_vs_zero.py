#!/usr/bin/env python3
"""The "pipeline vs ZeRO" page (issue 5), generated from measured run directories, never re-trained.

For each run: strategy, GPUs, schedule, global batch, tokens/s (and per GPU), peak GPU memory (the
worst rank), and for pipeline runs the measured vs simulated step time and bubble (the simulator fed
with the run's own per-stage forward/backward times). Runs that compare at different precision,
global batch or sequence length are flagged.

    python3 benchmarks/pipeline_vs_zero.py RUN_DIR... --out page.md [--json rows.json]

A run is named by its directory, or for a `shardlab bench` run directory (BENCH_DIR/runs/LABEL/rK) by its cell's label.
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
    cfg_path = run_dir / "config.yaml"
    label = run_name(run_dir)
    row = {
        "run": label, "strategy": s["strategy"], "gpus": s["world_size"], "precision": s["precision"],
        "model": s["model"], "seq_len": s["seq_len"], "global_batch": s["global_batch"], "micro_batch": s["micro_batch"],
        "tokens_per_s": s.get("tokens_per_s"), "peak_gib": s.get("gpu_mem_peak_gib"),
        "final_loss": s.get("final_train_loss"), "config": str(cfg_path),
    }
    if row["tokens_per_s"]:
        row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / row["gpus"]
    pp = s.get("pipeline")
    if pp:
        row.update(schedule=pp["schedule"], stages=pp["stages"], microbatches=pp["microbatches"], split=pp["split"],
                   measured_step_ms=pp["measured_step_ms"], simulated_step_ms=pp["simulated_step_ms"],
                   measured_bubble=pp["measured_bubble"], simulated_bubble=pp["simulated_bubble"],
                   stage_fwd_ms=pp["stage_fwd_ms"], stage_bwd_ms=pp["stage_bwd_ms"])
    return row


def page(rows: list[dict]) -> str:
    ref = rows[0]
    keys = ("model", "precision", "seq_len", "global_batch")
    out = ["# Pipeline parallelism vs ZeRO / FSDP, measured", "",
           f"Model {ref['model']}, {ref['precision']}, seq {ref['seq_len']}, global batch {ref['global_batch']} "
           "sequences per optimizer step (every row, unless flagged).", "",
           "| run | strategy | GPUs | schedule (M) | tok/s | tok/s per GPU | peak GiB (worst GPU) | final loss | pipeline step ms measured / simulated | bubble measured / simulated | flag |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = ", ".join(f"{k} {r[k]} ≠ {ref[k]}" for k in keys if r[k] != ref[k])
        sched = f"{r['schedule']} ({r['microbatches']})" if "schedule" in r else "-"
        steps = f"{r['measured_step_ms']:.0f} / {r['simulated_step_ms']:.0f}" if "schedule" in r else ""
        bub = f"{r['measured_bubble']:.1%} / {r['simulated_bubble']:.1%}" if "schedule" in r else ""
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "failed"
        per = f"{r['tokens_per_s_per_gpu']:,.0f}" if r.get("tokens_per_s_per_gpu") else ""
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else ""
        loss = f"{r['final_loss']:.3f}" if r.get("final_loss") is not None else ""
        out.append(f"| {r['run']} | {r['strategy']} | {r['gpus']} | {sched} | {tps} | {per} | {peak} | {loss} | {steps} | {bub} | {flag} |")
    pps = [r for r in rows if "schedule" in r]
    if pps:
        out += ["", "## Per-stage times measured in the pipeline runs (ms per micro-batch)", "",
                "| run | split (blocks per stage) | forward | backward |", "|---|---|---|---|"]
        for r in pps:
            split = ", ".join(f"{a}-{b}" for a, b in r["split"])
            out.append(f"| {r['run']} | {split} | {', '.join(f'{x:.1f}' for x in r['stage_fwd_ms'])} | "
                       f"{', '.join(f'{x:.1f}' for x in r['stage_bwd_ms'])} |")
        out += ["", "Simulated = `shardlab pipeline simulate` fed with these per-stage times and no communication "
                "cost; measured = the wall time of the schedule's step (p2p transfers and waits included), warm-up "
                "steps excluded. The gap between them is what communication and scheduling overhead cost."]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [r for r in (load(Path(d)) for d in args.runs) if r is not None]
    missing = [d for d in args.runs if not (Path(d) / "summary.json").is_file()]
    if not rows:
        print("error: none of the run directories has a summary.json (fix: pass finished runs)", file=sys.stderr)
        return 2
    text = page(rows) + ("".join(f"\nNot finished (no summary.json): {d}" for d in missing) + "\n" if missing else "")
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
