#!/usr/bin/env bash
# What ZeRO-3 keeps at its GPU peak under --compile against eager (the planner is 3-7% low for llama-3.2-1b zero3
# --compile, and counts bloom's compiled blocks 8-17% high: benchmarks/results/2026-11-29-h200-zero3-compile-scope).
# Trains each cell once (gpu_cells.sh), then replays each run's allocations to its peak (peak_snapshot.py).
#   OUT=$OUT bash benchmarks/diag/gpu_zero3_compile_peaks.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
C="--model llama-3.2-1b --seq-len 1024 --precision bf16 --micro-batch 8 --dataset synthetic --eval-split 0 --no-export --log-every 5 --max-steps 10"
cat > /tmp/zero3-peaks.txt <<'CELLS'
zero3-g1                  150 --strategy zero3 --gpus 1
zero3-g1-compile-model    200 --strategy zero3 --gpus 1 --compile --set compile_scope=model
CELLS
OUT=$OUT/cells ROOT=/tmp/zp COMMON="$C" CELLS_FILE=/tmp/zero3-peaks.txt BUDGET_S=300 bash benchmarks/gpu_cells.sh
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/diag
for cell in zero3-g1 zero3-g1-compile-model; do
  echo "=== peak of $cell"
  timeout "${SNAP_S:-150}" python3 benchmarks/diag/peak_snapshot.py /tmp/zp/runs/$cell/r1 --steps 3 --innermost --top 25 --recent 0 \
    2>&1 | grep -v Warning | tail -45
done
