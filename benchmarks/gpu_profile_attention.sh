#!/usr/bin/env bash
# Issue 15: why sdpa_backend=cudnn, 1.6x faster than flash in sdpa_probe.py at gpt2-medium's shape, does not speed up
# the model. Profiles shardlab dp (gpt2-medium, micro 8 eager and micro 16 --compile) with the default SDPA order and with
# cuDNN first, and diffs the operator tables (profile_dp.py compare). One H100 device call (carry: [".whl"]):
#   bash benchmarks/gpu_profile_attention.sh
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
run() {  # label micro extra...
  local label=$1 micro=$2; shift 2
  python3 -m shardlab train --model gpt2-medium --seq-len 1024 --precision bf16 --strategy dp --micro-batch "$micro" \
    --grad-accum 1 --max-steps 14 --dataset synthetic --eval-split 0 --set max_grad_norm=null --no-export --log-every 7 \
    --profile --output-dir "/tmp/prof-$label" --overwrite "$@" > "/tmp/prof-$label.log" 2>&1 || { echo "$label FAILED"; tail -5 "/tmp/prof-$label.log"; }
  python3 -c "import json; s=json.load(open('/tmp/prof-$label/summary.json')); print('$label', round(s['tokens_per_s']), 'tok/s')" || true
  grep -i "attention" "/tmp/prof-$label/profile/ops_rank0.txt" | head -12 | cut -c1-200 || true
}
run eager-auto 8
run eager-cudnn 8 --set sdpa_backend=cudnn
python3 benchmarks/profile_dp.py compare /tmp/prof-eager-auto/profile /tmp/prof-eager-cudnn/profile --top 25
if [[ "${COMPILED:-1}" == 1 ]]; then
  run compile-auto 16 --compile
  run compile-cudnn 16 --compile --set sdpa_backend=cudnn
  python3 benchmarks/profile_dp.py compare /tmp/prof-compile-auto/profile /tmp/prof-compile-cudnn/profile --top 25
fi
for l in eager-auto eager-cudnn compile-auto compile-cudnn; do
  [[ -f /tmp/prof-$l/profile/ops_rank0.txt ]] && cp /tmp/prof-$l/profile/ops_rank0.txt "$OUT/ops-$l.txt"
done
ls -la "$OUT"
