#!/usr/bin/env bash
# One device call: install the offline wheelhouse, run `shardlab bench` and bring back its report.
#   bash benchmarks/bench_gpu.sh NAME BENCH_ARGS...
#   e.g. bash benchmarks/bench_gpu.sh strategies-gpt2-medium --suite strategies
# The bench directory (every run directory) stays in /tmp/bench/NAME on the GPU machine; $OUT gets
# NAME.md (the report), NAME.html (self-contained) and NAME.tgz (report/, bench.json, every run's
# summary.json, config.yaml, metrics.jsonl, gpu_memory.csv, cpu_memory.csv and the logs).
# Re-running the same command on the same machine keeps finished cells (a bench cut short continues).
set -euo pipefail
NAME="$1"; shift
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/$NAME.gpu.txt"
BENCH=/tmp/bench/$NAME
set +e
python3 -m shardlab bench --output-dir "$BENCH" "$@" 2>&1 | tee "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
set -e
if [[ -d "$BENCH/report" ]]; then
  cp "$BENCH/report/report.md" "$OUT/$NAME.md"
  cp "$BENCH/report/report.html" "$OUT/$NAME.html"
fi
if [[ -d "$BENCH" ]]; then  # whatever exists, also after a bench cut short
  (cd "$BENCH" && tar czf "$OUT/$NAME.tgz" $(ls -d bench.json cells logs report 2>/dev/null) \
     $(find runs -maxdepth 3 \( -name summary.json -o -name config.yaml -o -name metrics.jsonl -o -name env.json \
                                -o -name gpu_memory.csv -o -name cpu_memory.csv \) 2>/dev/null)) || true
fi
ls -la "$OUT"
exit "$rc"
