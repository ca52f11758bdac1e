#!/usr/bin/env bash
# Issue 15, fsdp on one GPU: shardlab before and after a change, side by side in one device call, interleaved repeats.
#   BEFORE=path/to/old/tree VARIANTS="after:dp before:fsdp after:fsdp" REPEATS=3 BUDGET_S=500 bash benchmarks/gpu_fsdp_before_after.sh
# Each VARIANT is TREE:CELL: TREE 'after' is this checkout, 'before' the tree at $BEFORE (its src/ only: e.g.
# `git archive <commit> src | tar -x -C $BEFORE`); CELL a benchmarks/speed_gpu.py cell (gpt2-medium seq 1024 bf16,
# synthetic data, no clipping), run by this checkout's speed_gpu.py with PYTHONPATH on the tree's src/.
# WARM="before:fsdp-compile after:fsdp-compile ...": before the timed repeats, short runs of these cells, one after
# another, fill inductor's cache, so every timed compiled run finds its graphs cached, as the others do. (Run in
# parallel, three cold compiles never finished within 540 s on the H100: results/2026-11-26-h100-fsdp/call5.)
# Results: $OUT/ba/{log.txt,<tree>/speed.json,table.md}.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; R="$OUT/ba"; mkdir -p "$R"
BUDGET_S="${BUDGET_S:-500}"; REPEATS="${REPEATS:-3}"; STEPS="${STEPS:-20}"; BEFORE="${BEFORE:?set BEFORE}"
VARIANTS="${VARIANTS:-after:dp before:fsdp after:fsdp}"; WARM="${WARM:-}"
exec > >(tee -a "$R/log.txt") 2>&1
source benchmarks/gpu_env.sh
BASE_PP=/tmp/site:$PWD/benchmarks  # each run's PYTHONPATH: its tree's src/, then these (gpu_env.sh's, less this src/)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
PYTHONPATH=$PWD/src:$BASE_PP python3 -c "import torch, transformers; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)" | tee -a "$R/gpu.txt"
src_of() { [[ "$1" == before ]] && echo "$BEFORE/src" || echo "$PWD/src"; }
left() { echo $(( BUDGET_S - SECONDS )); }
if [[ -n "$WARM" ]]; then
  echo "=== warming inductor's cache: $WARM ($SECONDS s)"
  for v in $WARM; do
    tree=${v%%:*}; cell=${v#*:}
    PYTHONPATH=$(src_of "$tree"):$BASE_PP python3 benchmarks/speed_gpu.py --out "/tmp/warm-$tree-$cell" --runs "/tmp/warm-runs-$tree-$cell" \
      --cells "$cell" --steps 3 --timeout 300 > "/tmp/warm-$tree-$cell.log" 2>&1 || echo "warm $v FAILED"
  done
  echo "=== warm done ($SECONDS s)"; grep -h "^\[" /tmp/warm-*.log
fi
for rep in $(seq 1 "$REPEATS"); do
  for v in $VARIANTS; do
    tree=${v%%:*}; cell=${v#*:}
    echo "=== repeat $rep $tree:$cell, $(left) s left"
    PYTHONPATH=$(src_of "$tree"):$BASE_PP python3 benchmarks/speed_gpu.py --out "$R/$tree" --runs "/tmp/ba-runs-$tree" --cells "$cell" \
      --steps "$STEPS" --budget-s "$(left)" | grep -E "^\[" || echo "$tree:$cell FAILED"
  done
done
python3 - "$R" <<'PY' | tee "$R/table.md"
import json, statistics, sys
from pathlib import Path
R = Path(sys.argv[1])
rows = {}
for tree in ("before", "after"):
    f = R / tree / "speed.json"
    for r in (json.loads(f.read_text()) if f.is_file() else []):
        if "summary" in r:
            rows.setdefault(f"{tree}:{r['label']}", []).append(r["summary"])
med = {k: statistics.median(s["tokens_per_s"] for s in v) for k, v in rows.items()}
print("| tree:cell | runs | tok/s median | each run | MFU | peak GiB | planned GiB | final loss |")
print("|---|---|---|---|---|---|---|---|")
for k, v in rows.items():
    mfu = statistics.median(s.get("mfu") or 0 for s in v)
    print(f"| {k} | {len(v)} | {med[k]:,.0f} | {', '.join(format(s['tokens_per_s'], ',.0f') for s in v)} | {mfu:.1%} | "
          f"{max(s.get('gpu_mem_peak_gib', 0) for s in v):.2f} | {(v[0].get('plan') or {}).get('gpu_peak_gib')} | "
          f"{v[0].get('final_train_loss', float('nan')):.4f} |")
for k in med:
    tree, cell = k.split(":", 1)
    if cell.startswith("fsdp"):
        ref = "after:dp-compile" if "compile" in cell else "after:dp"
        if ref in med:
            print(f"\n{k} / {ref} = {med[k] / med[ref]:.3f}", end="")
print()
PY
