#!/usr/bin/env bash
# One device call: shardlab against HF Trainer + DeepSpeed and the bare PyTorch loop (benchmarks/peers.py).
#   bash benchmarks/peers.sh [MODEL] [STRATEGY] [STEPS] [more peers.py flags, e.g. --compile]
#   e.g. bash benchmarks/peers.sh gpt2-medium zero2 40          # ~7 min on an H100; --compile adds ~3 min
# $OUT gets peers.md (ratios), peers.json and peers.tgz (every log, shardlab's bench report and run summaries).
set -euo pipefail
MODEL="${1:-gpt2-medium}"; STRATEGY="${2:-zero2}"; STEPS="${3:-40}"; shift $(( $# < 3 ? $# : 3 ))
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
P=/tmp/peers
set +e
python3 benchmarks/peers.py --model "$MODEL" --strategy "$STRATEGY" --steps "$STEPS" --out "$P" "$@" 2>&1 | tee "$OUT/peers.log"
rc=${PIPESTATUS[0]}
set -e
cp "$P/peers.md" "$P/peers.json" "$OUT/" 2>/dev/null || true
(cd "$P" && tar czf "$OUT/peers.tgz" $(ls -d *.log *.json *.yaml bench/bench.json bench/report bench/logs 2>/dev/null) \
   $(find bench/runs -maxdepth 3 \( -name summary.json -o -name config.yaml -o -name gpu_memory.csv -o -name cpu_memory.csv \) 2>/dev/null)) || true
exit "$rc"
