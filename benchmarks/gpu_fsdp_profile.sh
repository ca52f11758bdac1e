#!/usr/bin/env bash
# Issue 15: profiled shardlab runs (--profile: 4 steady steps) of gpt2-medium seq 1024 bf16, eager micro 8 unless the
# label says compile (micro 16), for the labels in $LABELS; traces gzipped into $OUT. Run from the repository root
# (.whl carried).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
LABELS="${LABELS:-dp fsdp}"
declare -A EXTRA=(
  [dp]="--strategy dp --micro-batch 8"
  [fsdp]="--strategy fsdp --micro-batch 8"
  [fsdp-blocks]="--strategy fsdp --micro-batch 8 --set strategy_options.fsdp_units=blocks --set strategy_options.fsdp_gather_after_step=false"
  [dp-compile]="--strategy dp --micro-batch 16 --compile"
  [fsdp-compile]="--strategy fsdp --micro-batch 16 --compile"
)
for label in $LABELS; do
  echo "=== $label ($SECONDS s)"
  # shellcheck disable=SC2086
  python3 -m shardlab train --model gpt2-medium --seq-len 1024 --precision bf16 --grad-accum 1 \
    --max-steps 14 --dataset synthetic --eval-split 0 --set max_grad_norm=null --no-export --log-every 7 --profile \
    --output-dir "/tmp/prof-$label" --overwrite ${EXTRA[$label]} > "/tmp/prof-$label.log" 2>&1 \
    || { echo "$label FAILED"; tail -20 "/tmp/prof-$label.log"; continue; }
  grep -E "FSDP2|memory|tokens/s" "/tmp/prof-$label.log" | head -5
  cat "/tmp/prof-$label/profile/steps_rank0.json"
  gzip -c "/tmp/prof-$label/profile/trace_rank0.json" > "$OUT/trace-$label.json.gz"
  cp "/tmp/prof-$label/profile/ops_rank0.txt" "$OUT/ops-$label.txt"
done
