#!/usr/bin/env bash
# Issue 15: profiled shardlab runs (--profile: 4 steady steps) of gpt2-medium seq 1024 bf16, eager micro 8 unless the
# label says compile (micro 16), for the labels in $LABELS; traces gzipped into $OUT (trace-LABEL.json.gz, ops-LABEL.txt).
# Run from the repository root (.whl carried):
#   LABELS="dp fsdp" T=300 bash benchmarks/gpu_fsdp_profile.sh
# The runs are the cells of one bench (`shardlab bench --cells`, a file written here from $LABELS, into
# /tmp/fsdp-profile: a fresh process per run, each stopped after T seconds, failures recorded with their reason).
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
B=/tmp/fsdp-profile; mkdir -p "$B"
for label in $LABELS; do echo "$label ${T:-300} ${EXTRA[$label]}"; done > "$B/cells.txt"
python3 -m shardlab bench --cells "$B/cells.txt" --no-report --output-dir "$B" --cell-flags "--model gpt2-medium --seq-len 1024
  --precision bf16 --grad-accum 1 --max-steps 14 --dataset synthetic --eval-split 0 --set max_grad_norm=null --no-export
  --log-every 7 --profile"
for label in $LABELS; do
  d="$B/runs/$label/r1"; log="$B/logs/$label-r1.log"
  echo "=== $label"
  [[ -f "$d/summary.json" ]] || { echo "$label FAILED"; tail -20 "$log"; continue; }
  grep -E "FSDP2|memory|tokens/s" "$log" | head -5
  cat "$d/profile/steps_rank0.json"
  gzip -c "$d/profile/trace_rank0.json" > "$OUT/trace-$label.json.gz"
  cp "$d/profile/ops_rank0.txt" "$OUT/ops-$label.txt"
done
