#!/usr/bin/env bash
# Issue 15: why fsdp --compile runs at 0.70x dp --compile on one H100 (gpt2-medium, micro 16, bf16), and why the planner's
# compiled peaks are +6%. One device call (carry: [".whl"]):
#   bash benchmarks/gpu_fsdp_compile.sh          # LABELS="..." SNAP="..." T=300 (seconds per run)
# 1. Profiled runs (--profile: 4 steady steps; steps_rank0.json = step wall vs GPU busy) of the cells in $LABELS:
#    dp --compile (whole model), fsdp --compile under each compile_scope, and fsdp without resharding after forward.
#    They are the cells of one bench (`shardlab bench --cells`, a file written here from $LABELS, into /tmp/fsdpc-bench:
#    a fresh process per run, each stopped after T seconds, failures recorded with their reason, finished runs kept).
# 2. benchmarks/diag/peak_snapshot.py on the runs in $SNAP: the blocks alive at the peak, by what allocated them.
# Results: $OUT/fsdpc/{log.txt,ops.tar.gz (each run's ops table, steps_rank0.json, summary and log; bench.json),snap-*.txt}.
set -euo pipefail
OUT="${OUT:-/tmp/out}"; R="$OUT/fsdpc"; mkdir -p "$R"
exec > >(tee -a "$R/log.txt") 2>&1
source benchmarks/gpu_env.sh
LABELS="${LABELS:-dp-compile fsdp-compile fsdp-compile-blocks fsdp-compile-noreshard}"; SNAP="${SNAP:-dp-compile fsdp-compile}"
declare -A EXTRA=(
  [dp-compile]="--strategy dp --compile"
  [dp-compile-blocks]="--strategy dp --compile --set compile_scope=blocks"
  [fsdp-compile]="--strategy fsdp --compile"
  [fsdp-compile-blocks]="--strategy fsdp --compile --set compile_scope=blocks"
  [fsdp-compile-noreshard]="--strategy fsdp --compile --set strategy_options.fsdp_reshard_after_forward=false"
  [fsdp]="--strategy fsdp --micro-batch 8"
  [dp]="--strategy dp --micro-batch 8"
)
B=/tmp/fsdpc-bench; mkdir -p "$B"
# micro 16 first: a cell's own --micro-batch (the eager ones: 8) comes after it and wins
for label in $LABELS; do echo "$label ${T:-300} --micro-batch 16 ${EXTRA[$label]}"; done > "$B/cells.txt"
python3 -m shardlab bench --cells "$B/cells.txt" --no-report --output-dir "$B" --cell-flags "--model gpt2-medium --seq-len 1024
  --precision bf16 --grad-accum 1 --max-steps 14 --dataset synthetic --eval-split 0 --set max_grad_norm=null --no-export
  --log-every 7 --profile"
for label in $LABELS; do
  d="$B/runs/$label/r1"
  echo "=== $label"
  [[ -f "$d/summary.json" ]] || { echo "$label FAILED"; tail -5 "$B/logs/$label-r1.log" || true; continue; }
  python3 - "$label" "$d" <<'PY'
import json, sys
label, d = sys.argv[1], sys.argv[2]
s = json.load(open(f"{d}/summary.json")); st = json.load(open(f"{d}/profile/steps_rank0.json"))
keys = ("tokens_per_s", "mfu", "gpu_mem_peak_gib", "compile_time_s", "time_to_first_step_s", "compile_scope")
print(label, {k: s.get(k) for k in keys}, "profiled step wall ms", round(st["mean_step_wall_ms"] or 0, 1),
      "GPU busy ms", round(st["mean_device_busy_ms"] or 0, 1), "idle ms", round(st.get("mean_device_idle_ms") or 0, 1))
PY
  python3 -c "import json, sys; p=json.load(open(sys.argv[1])).get('plan') or {}; print('plan', {k: v for k, v in p.items() if 'gpu' in k})" \
    "$d/summary.json" || true
  head -28 "$d/profile/ops_rank0.txt" | cut -c1-72,150-230
done
(cd "$B" && tar -czf "$R/ops.tar.gz" bench.json $(ls -d runs/*/r*/profile/ops_rank0.* runs/*/r*/profile/steps_rank0.json runs/*/r*/summary.json logs/*.log 2>/dev/null)) || true
for label in $SNAP; do
  echo "=== snapshot $label ($SECONDS s)"
  timeout 200 python3 benchmarks/diag/peak_snapshot.py "$B/runs/$label/r1" --steps 3 > "$R/snap-$label.txt" 2>"/tmp/snap-$label.err" \
    || { echo "snapshot $label FAILED"; tail -5 "/tmp/snap-$label.err"; }
  cat "$R/snap-$label.txt"
done
ls -la "$R"
