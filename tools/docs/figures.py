"""The docs' pictures and measured tables, regenerated from the code and committed runs at every docs build.

    python tools/docs/figures.py OUT_DIR

writes, in parallel child processes (each imports shardlab once; the build waits for all):
  OUT_DIR/report/            `shardlab report` of the committed one-H200 strategies bench (HTML page and plots)
  OUT_DIR/pipeline/          the simulator's timelines of GPipe, 1F1B and interleaved 1F1B, and its tutorial diagrams
  OUT_DIR/plan-7b.json       `shardlab plan --json` for a 7B model on one 80 GB GPU with 125 GiB of host RAM
Nothing here trains or needs a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORT_BENCH = "benchmarks/results/2026-11-21-h200x4-session2/strategies"  # one H200 per run, gpt2-medium, 7 strategies
PLAN_7B = ["--model", "bloom-7b1", "--seq-len", "1024", "--micro-batch", "1", "--precision", "bf16",
           "--gradient-checkpointing", "--gpu-memory-gb", "80", "--host-ram-gb", "125", "--json"]
PIPELINE_SCRIPT = """
import sys
from pathlib import Path
from shardlab.pipesim import render_timeline, simulate, tutorial_diagrams
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
for name, kw in [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {"chunks": 2})]:
    tl = simulate(name, 4, 8, fwd=1, bwd=2, **kw)
    render_timeline(tl, out / f"timeline-{name}.png")
    (out / f"timeline-{name}.txt").write_text(f"{tl.metrics['bubble_fraction']:.4f}")
tutorial_diagrams(out)
"""


def environment() -> dict[str, str]:
    """This checkout's shardlab first on the path (not an installed copy), offline, matplotlib without a display."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", MPLBACKEND="Agg", COLUMNS="160")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def generate(out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    py, env = sys.executable, environment()
    jobs = {
        "report": [py, "-m", "shardlab", "report", str(ROOT / REPORT_BENCH), "-o", str(out / "report")],
        "pipeline": [py, "-c", PIPELINE_SCRIPT, str(out / "pipeline")],
        "plan-7b": [py, "-m", "shardlab", "plan", *PLAN_7B],
    }
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in jobs.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        if proc.returncode:
            raise RuntimeError(f"docs figures: {' '.join(jobs[name][:4])} failed ({proc.returncode}): {stderr[-2000:]}")
        if name == "plan-7b":
            json.loads(stdout)  # a plan, not a message
            (out / "plan-7b.json").write_text(stdout)
    return {"report": out / "report", "pipeline": out / "pipeline", "plan-7b": out / "plan-7b.json"}


GIB = 2**30


def plan_tables(plan: dict) -> dict[str, str]:
    """Markdown tables from `shardlab plan --json`: where each strategy keeps what, and the recommendation."""
    head = (f"`shardlab plan {' '.join(PLAN_7B[:-1])}` ({plan['model']}: {plan['n_params'] / 1e9:.2f} B parameters, "
            f"seq {plan['seq_len']}, micro {plan['micro_batch']}, {plan['precision']}, gradient checkpointing), "
            "computed when these docs were built:")
    rows = ["| strategy | model states, bytes/param on the GPU | params | grads | optimizer | activations + logits | "
            "GPU peak | host per node | fits one 80 GB GPU + 125 GiB host | where the states live |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in plan["strategies"].items():
        gpu = s["gpu"]
        act = gpu.get("activations", 0) + gpu.get("logits (loss)", 0)
        where = (s.get("notes") or [""])[0].replace("|", "/")
        rows.append(f"| `{name}` | {s['model_state_bytes_per_param']:g} | {gpu['parameters'] / GIB:.1f} | "
                    f"{gpu['gradients'] / GIB:.1f} | {gpu['optimizer'] / GIB:.1f} | {act / GIB:.1f} | "
                    f"{s['gpu_peak'] / GIB:.1f} | {s['cpu_per_node'] / GIB:.1f} | {'yes' if s['fits'] else 'no'} | {where} |")
    fits = ["| strategy | GPU peak GiB | host GiB per node | fits | why not |", "|---|---|---|---|---|"]
    for name, s in plan["strategies"].items():
        why = "" if s["fits"] else (s.get("why") or "").replace("|", "/")
        fits.append(f"| `{name}` | {s['gpu_peak'] / GIB:.1f} | {s['cpu_per_node'] / GIB:.1f} | "
                    f"{'yes' if s['fits'] else 'no'} | {why} |")
    rec = plan.get("recommendation")
    recommendation = (f"**Recommended: `{rec}`.** {plan.get('reason', '')}" if rec else "Nothing fits as planned.")
    if plan.get("next_option"):
        recommendation += f"\n\nNext option: {plan['next_option']}"
    if plan.get("recommended_flags"):
        recommendation += f"\n\nFlags: `{plan['recommended_flags']}`"
    return {"plan-7b-table": head + "\n\n" + "\n".join(rows), "plan-7b-fits": head + "\n\n" + "\n".join(fits),
            "plan-7b-recommendation": recommendation}


if __name__ == "__main__":
    print(generate(Path(sys.argv[1])))
