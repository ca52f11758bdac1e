#!/usr/bin/env bash
# Is a two-GPU run's shortfall the wire or the machine? Runs the same one-GPU `shardlab train` twice at once, one on
# each GPU (CUDA_VISIBLE_DEVICES 0 and 1, no communication between them), ROUNDS times, and prints each run's useful
# tok/s. If each twin keeps the speed of a one-GPU run alone, what a two-rank run loses is its collectives and
# synchronisation; if the twins slow down by themselves, the machine (power, host, memory) caps weak scaling.
#   FLAGS="--model llama-3.2-1b --strategy dp --seq-len 1024 --precision bf16 --micro-batch 8 --dataset synthetic \
#          --eval-split 0 --no-export --log-every 5 --max-steps 20" ROUNDS=2 bash benchmarks/diag/gpu_twin_singles.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROOT=/tmp/twins; mkdir -p "$ROOT"
source benchmarks/gpu_env.sh
for round in $(seq 1 "${ROUNDS:-2}"); do
  for gpu in 0 1; do
    # shellcheck disable=SC2086  # FLAGS is a list of flags
    CUDA_VISIBLE_DEVICES=$gpu timeout "${TIMEOUT_S:-150}" python3 -m shardlab train $FLAGS --gpus 1 \
      --output-dir "$ROOT/r$round-gpu$gpu" > "$ROOT/r$round-gpu$gpu.log" 2>&1 &
  done
  wait
  for gpu in 0 1; do
    python3 - "$ROOT/r$round-gpu$gpu" <<'PY'
import json, sys
from pathlib import Path
found = sorted(Path(sys.argv[1]).rglob("summary.json"))
if not found:
    print(f"{sys.argv[1]}: no summary.json (see its .log)")
else:
    s = json.loads(found[-1].read_text())
    tps = s.get("useful_tokens_per_s") or s.get("tokens_per_s")
    print(f"{sys.argv[1]}: {tps:,.0f} useful tok/s, peak {s.get('gpu_mem_peak_gib') or 0:.2f} GiB")
PY
  done
done | tee "$OUT/twins.txt"
