#!/usr/bin/env bash
# Issue 15: why fsdp --compile runs at 0.70x dp --compile on one H100 (gpt2-medium, micro 16, bf16), and why the planner's
# compiled peaks are +6%. One device call (carry: [".whl"]):
#   bash benchmarks/gpu_fsdp_compile.sh
# 1. Profiled runs (--profile: 4 steady steps; steps_rank0.json = step wall vs GPU busy) of the cells in $LABELS:
#    dp --compile (whole model), fsdp --compile under each compile_scope, and fsdp without resharding after forward.
# 2. benchmarks/diag/peak_snapshot.py on the runs in $SNAP: the blocks alive at the peak, by what allocated them.
# Results: $OUT/fsdpc/{log.txt,ops.tar.gz,snap-*.txt}.
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
for label in $LABELS; do
  echo "=== $label ($SECONDS s)"
  # shellcheck disable=SC2086
  python3 -m shardlab train --model gpt2-medium --seq-len 1024 --precision bf16 --micro-batch 16 --grad-accum 1 \
    --max-steps 14 --dataset synthetic --eval-split 0 --set max_grad_norm=null --no-export --log-every 7 --profile \
    --output-dir "/tmp/prof-$label" --overwrite ${EXTRA[$label]} > "/tmp/prof-$label.log" 2>&1 \
    || { echo "$label FAILED"; tail -5 "/tmp/prof-$label.log"; continue; }
  python3 - "$label" <<'PY'
import json, sys
label = sys.argv[1]; d = f"/tmp/prof-{label}"
s = json.load(open(f"{d}/summary.json")); st = json.load(open(f"{d}/profile/steps_rank0.json"))
keys = ("tokens_per_s", "mfu", "gpu_mem_peak_gib", "compile_time_s", "time_to_first_step_s", "compile_scope")
print(label, {k: s.get(k) for k in keys}, "profiled step wall ms", round(st["mean_step_wall_ms"] or 0, 1),
      "GPU busy ms", round(st["mean_device_busy_ms"] or 0, 1), "idle ms", round(st.get("mean_device_idle_ms") or 0, 1))
PY
  python3 -c "import json; p=json.load(open('/tmp/prof-$label/summary.json')).get('plan') or {}; print('plan', {k: v for k, v in p.items() if 'gpu' in k})" || true
  head -28 "/tmp/prof-$label/profile/ops_rank0.txt" | cut -c1-72,150-230
done
(cd /tmp && tar -czf "$R/ops.tar.gz" $(ls -d prof-*/profile/ops_rank0.* prof-*/profile/steps_rank0.json prof-*/summary.json prof-*.log 2>/dev/null)) || true
for label in $SNAP; do
  echo "=== snapshot $label ($SECONDS s)"
  timeout 200 python3 benchmarks/diag/peak_snapshot.py "/tmp/prof-$label" --steps 3 > "$R/snap-$label.txt" 2>"/tmp/snap-$label.err" \
    || { echo "snapshot $label FAILED"; tail -5 "/tmp/snap-$label.err"; }
  cat "$R/snap-$label.txt"
done
ls -la "$R"
