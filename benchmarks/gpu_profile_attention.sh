#!/usr/bin/env bash
# Issue 15: why sdpa_backend=cudnn, 1.6x faster than flash in sdpa_probe.py at gpt2-medium's shape, does not speed up
# the model. Profiles shardlab dp (gpt2-medium, micro 8 eager and micro 16 --compile) with the default SDPA order and with
# cuDNN first, and diffs the operator tables (profile_dp.py compare). One H100 device call (carry: [".whl"]):
#   bash benchmarks/gpu_profile_attention.sh      # COMPILED=0: the eager pair only; T=300 seconds per run
# The profiled runs are the cells of one bench (`shardlab bench --cells`, a file written here, into /tmp/prof-attention:
# a fresh process per run, its own time limit, failures recorded with their reason). Results: $OUT/log.txt (the
# comparisons), $OUT/ops-LABEL.txt (each run's operator table).
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
B=/tmp/prof-attention; mkdir -p "$B"
LABELS="eager-auto eager-cudnn"; [[ "${COMPILED:-1}" == 1 ]] && LABELS="$LABELS compile-auto compile-cudnn"
{
  echo "eager-auto ${T:-300} --micro-batch 8"
  echo "eager-cudnn ${T:-300} --micro-batch 8 --set sdpa_backend=cudnn"
  if [[ "${COMPILED:-1}" == 1 ]]; then
    echo "compile-auto ${T:-300} --micro-batch 16 --compile"
    echo "compile-cudnn ${T:-300} --micro-batch 16 --compile --set sdpa_backend=cudnn"
  fi
} > "$B/cells.txt"
python3 -m shardlab bench --cells "$B/cells.txt" --no-report --output-dir "$B" --cell-flags "--model gpt2-medium --seq-len 1024
  --precision bf16 --strategy dp --grad-accum 1 --max-steps 14 --dataset synthetic --eval-split 0 --set max_grad_norm=null
  --no-export --log-every 7 --profile"
for label in $LABELS; do
  d="$B/runs/$label/r1"
  [[ -f "$d/summary.json" ]] || { echo "$label FAILED"; tail -5 "$B/logs/$label-r1.log" || true; continue; }
  python3 -c "import json, sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], round(s['tokens_per_s']), 'tok/s')" "$d/summary.json" "$label" || true
  grep -i "attention" "$d/profile/ops_rank0.txt" | head -12 | cut -c1-200 || true
  cp "$d/profile/ops_rank0.txt" "$OUT/ops-$label.txt" || true
done
compare() { python3 benchmarks/profile_dp.py compare "$B/runs/$1/r1/profile" "$B/runs/$2/r1/profile" --top 25 || echo "compare $1 $2 FAILED"; }
compare eager-auto eager-cudnn
[[ "${COMPILED:-1}" == 1 ]] && compare compile-auto compile-cudnn
ls -la "$OUT"
