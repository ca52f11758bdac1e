"""shardlab train vs the bare references, side by side on one GPU machine (issue: train foundation).

Runs `shardlab train` for gpt2-medium, seq 1024, bf16 under several strategies, each in a
fresh process, and compares tokens/s and peak allocated memory with the bare loops of
benchmarks/bare_reference.py measured in the same session (its JSON Lines file).

Same work on both sides: random-token data (shardlab's `synthetic` source, fully packed),
same micro batch, same precision, no gradient clipping (the bare loops do not clip), warm-up
steps excluded, median step time.

    python3 benchmarks/foundation_gpu.py --bare $OUT/bare.jsonl --out $OUT [--cells dp,zero2,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# label -> (strategy, micro batch, extra flags, bare reference mode it is compared with)
CELLS = {
    "dp": ("dp", 8, [], "eager-bf16"),
    "dp-clip": ("dp", 8, ["--set", "max_grad_norm=1.0"], "eager-bf16-clip"),
    "dp-compile": ("dp", 16, ["--compile"], "compile-bf16"),
    # the loss inside the model, as the bare loop computes it (the default on CUDA is shardlab.training.loss's fused kernel)
    "dp-compile-closs": ("dp", 16, ["--compile", "--set", "loss_kernel=compiled"], "compile-bf16"),  # the loss outside the model's graph
    "dp-hfloss": ("dp", 8, ["--set", "loss_kernel=hf"], "eager-bf16"),
    "zero2-hfloss": ("zero2", 8, ["--set", "loss_kernel=hf"], "ds-zero2"),
    "zero2": ("zero2", 8, [], "ds-zero2"),
    "zero3": ("zero3", 8, [], "ds-zero3"),
    "zero2_offload": ("zero2_offload", 8, [], "ds-zero2-offload"),
    "fsdp": ("fsdp", 8, [], None),
    "zero1": ("zero1", 8, [], "ds-zero1"),
    "zero0": ("zero0", 8, [], "ds-zero0"),
    "zero3_offload": ("zero3_offload", 8, [], "ds-zero3-offload"),
}
MIN_RATIO = {"dp": 1.0, "dp-compile-closs": 1.0, "dp-hfloss": 1.0, "zero2-hfloss": 0.95, "dp-clip": 1.0, "dp-compile": 1.0, "zero0": 0.95, "zero1": 0.95, "zero2": 0.95, "zero3": 0.95, "zero2_offload": 0.95, "zero3_offload": 0.95}


def run_cell(label: str, args: argparse.Namespace) -> dict:
    strategy, micro, extra, _ = CELLS[label]
    run_dir = Path(args.runs) / label
    tokens = int((args.steps + 2) * micro * args.seq * 1.08)  # one epoch covers every step
    cmd = [
        sys.executable, "-m", "shardlab", "train", "--model", args.model, "--seq-len", str(args.seq),
        "--precision", "bf16", "--strategy", strategy, "--micro-batch", str(micro), "--grad-accum", "1",
        "--max-steps", str(args.steps), "--dataset", "synthetic", "--set", f"dataset.synthetic_tokens={tokens}",
        "--eval-split", "0.02", "--set", "max_grad_norm=null", "--no-export", "--log-every", "10",
        "--output-dir", str(run_dir), "--overwrite", *extra,
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, text=True, capture_output=True, timeout=args.timeout)
    row = {"label": label, "command": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": round(time.time() - t0, 1)}
    if proc.returncode != 0:
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        print(f"[{label}] FAILED rc={proc.returncode}\n{row['error']}", flush=True)
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    row["summary"] = summary
    print(f"[{label}] {summary['tokens_per_s']:,.0f} tok/s, peak {summary.get('gpu_mem_peak_gib', float('nan')):.1f} GiB, "
          f"loss {summary['final_train_loss']:.3f} (loss kernel {summary.get('loss_kernel')}), {row['wall_s']} s", flush=True)
    return row


def load_bare(path: str) -> dict[str, list[dict]]:
    """Bare records by reference key ("mode", or "mode:micro" off its default micro), all repeats."""
    out: dict[str, list[dict]] = {}
    if path and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                key = rec["mode"] if rec.get("micro") in (8, None) or rec["mode"] == "compile-bf16" else f"{rec['mode']}:{rec['micro']}"
                out.setdefault(key, []).append(rec)
    return out


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:,.0f}" if len(values) == 1 else f"{med:,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def table(rows: list[dict], bare: dict[str, list[dict]]) -> str:
    """One line per cell: medians over repeats (each repeat's figure is itself a median over steps)."""
    lines = [
        "| shardlab cell | micro | repeats | shardlab tok/s (min–max) | peak GiB | bare reference | bare tok/s (min–max) | bare peak GiB | speed ratio | memory ratio | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_label: dict[str, list[dict]] = {}
    for row in rows:
        by_label.setdefault(row["label"], []).append(row)
    for label, runs in by_label.items():
        strategy, micro, extra, ref = CELLS[label]
        ok = [r["summary"] for r in runs if "summary" in r]
        if not ok:
            lines.append(f"| {label} | {micro} | {len(runs)} | failed (rc {runs[-1]['rc']}) | | {ref or '-'} | | | | | |")
            continue
        tps = [s["tokens_per_s"] for s in ok]
        peak = max(s.get("gpu_mem_peak_gib", float("nan")) for s in ok)
        b = bare.get(ref or "", [])
        b_tps = [r["tokens_per_s_median"] for r in b]
        b_peak = max((r["peak_alloc_gib"] for r in b), default=None)
        ratio = statistics.median(tps) / statistics.median(b_tps) if b_tps else None
        mem = peak / b_peak if b_peak else None
        goal = MIN_RATIO.get(label)
        verdict = "" if ratio is None or goal is None else (f"≥{goal} ✅" if ratio >= goal else f"≥{goal} ❌")
        lines.append(
            f"| {label} | {micro} | {len(ok)} | {_spread(tps)} | {peak:.1f} | {ref or '-'} | "
            f"{_spread(b_tps) if b_tps else ''} | {'' if b_peak is None else f'{b_peak:.1f}'} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} | {'' if mem is None else f'{mem:.2f}'} | {verdict} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bare", default=None, help="JSON Lines written by bare_reference.py in the same session")
    p.add_argument("--out", required=True, help="where foundation.json / foundation.md go")
    p.add_argument("--runs", default="/tmp/shardlab-runs", help="run directories (kept out of --out: only a few files travel back)")
    p.add_argument("--cells", default="dp,dp-compile,zero2,zero3,zero2_offload,fsdp")
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--table-only", action="store_true", help="no runs: the table over every repeat in --out/foundation.json")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = Path(args.out) / "foundation.json"
    rows = json.loads(results.read_text()) if results.is_file() else []
    if not args.table_only:
        for label in args.cells.split(","):
            row = run_cell(label, args)
            rows.append(row)
            results.write_text(json.dumps(rows, indent=1))  # a killed session keeps what finished
    md = table(rows, load_bare(args.bare))
    print(md)
    (Path(args.out) / "foundation.md").write_text(md + "\n")
    os.sync()


if __name__ == "__main__":
    main()
