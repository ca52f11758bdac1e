#!/usr/bin/env bash
# Issue 15, zero1/zero2 on one GPU: profile cells with shardlab's --profile (benchmarks/profile_cells.py), then time
# cells interleaved (speed_gpu.py, one repeat of every cell per round).
#   PROF_CELLS=dp,zero2,zero2-nocheck CELLS=dp,zero1,zero2 REPS=3 bash benchmarks/gpu_zero_speed.sh   (repo root, .whl carried)
# $OUT gets: speed.json / speed.md (every run, medians), prof.tar.gz (per profiled cell: steps, ops tables), trace-<cell>.json.gz
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
echo "cpu: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
PROF_CELLS=${PROF_CELLS-dp,zero2,zero2-nocheck}
CELLS=${CELLS:-dp,zero1,zero2}
REPS=${REPS:-3}
STEPS=${STEPS:-20}
BUDGET_S=${BUDGET_S:-520}
t0=$(date +%s)
if [[ -n "$PROF_CELLS" ]]; then
  python3 benchmarks/profile_cells.py --out /tmp/prof --cells "$PROF_CELLS"
  for d in /tmp/prof/prof-*; do mv "$d/trace_rank0.json.gz" "$OUT/trace-${d##*/prof-}.json.gz"; done
  (cd /tmp/prof && tar czf "$OUT/prof.tar.gz" .)
fi
for rep in $(seq "$REPS"); do
  left=$(( BUDGET_S - ($(date +%s) - t0) ))
  echo "== round $rep of $REPS ($left s of the budget left)"
  # the host CPU's speed this round (one-GPU zero3 is host-bound: its step follows it; 2026-11-27-h100-zero3-gc)
  python3 -c "import time; t = time.perf_counter(); sum(range(3_000_000)); print(f'cpu probe: {1e3 * (time.perf_counter() - t):.1f} ms for sum(range(3e6))')"
  python3 benchmarks/speed_gpu.py --out "$OUT" --steps "$STEPS" --cells "$CELLS" --budget-s "$left"
done
