#!/usr/bin/env bash
# Issue 15: the attention kernel (sdpa_backend) and torch.compile's mode (compile_mode) against the bare compiled loop,
# in one H100 device call of at most ~9 minutes (carry: [".whl"]):
#   bash benchmarks/gpu_attention.sh
# 1. benchmarks/sdpa_probe.py: fwd+bwd ms of flash / cuDNN / memory-efficient SDPA at the cells' shapes.
# 2. Interleaved repeats of: the bare compiled loop (bare_reference.py, first BARE_REPEATS repeats) and the cells
#    in $CELLS (speed_gpu.py: gpt2-medium seq 1024 bf16 synthetic data, no clipping), while BUDGET_S lasts; then the
#    cells in $ONCE (long compiles) once if time is left.
# Results: $OUT/attn/{gpu.txt,probe.json,log.txt,bare.jsonl,speed.json,speed.md,runs.tar.gz}.
set -euo pipefail
OUT="${OUT:-/tmp/out}"; R="$OUT/attn"; mkdir -p "$R"
BUDGET_S="${BUDGET_S:-530}"; REPEATS="${REPEATS:-3}"; BARE_REPEATS="${BARE_REPEATS:-2}"; RUNS=/tmp/shardlab-attn-runs
CELLS="${CELLS:-dp-compile,dp-compile-cudnn,dp,dp-cudnn}"; ONCE="${ONCE:-}"
exec > >(tee -a "$R/log.txt") 2>&1
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)" | tee -a "$R/gpu.txt"
left() { echo $(( BUDGET_S - SECONDS )); }
[[ "${PROBE:-1}" == 1 ]] && { timeout 120 python3 benchmarks/sdpa_probe.py --out "$R/probe.json" || echo "probe FAILED rc=$?"; }
for rep in $(seq 1 "$REPEATS"); do
  echo "=== repeat $rep, $(left) s left"
  if (( rep <= BARE_REPEATS && $(left) > 90 )); then
    python3 benchmarks/bare_reference.py --all --modes compile-bf16 --warmup 5 --steps 20 --out "$R/bare.jsonl" --timeout 200 \
      || echo "bare FAILED"
  fi
  python3 benchmarks/speed_gpu.py --out "$R" --runs "$RUNS" --cells "$CELLS" --steps 20 --budget-s "$(left)" --bare "$R/bare.jsonl" \
    || echo "cells FAILED"
done
if [[ -n "$ONCE" ]]; then
  python3 benchmarks/speed_gpu.py --out "$R" --runs "$RUNS" --cells "$ONCE" --steps 20 --budget-s "$(left)" --bare "$R/bare.jsonl" \
    || echo "cells FAILED"
fi
python3 benchmarks/speed_gpu.py --bare "$R/bare.jsonl" --out "$R" --cells "" --table-only
(cd "$RUNS" && tar -czf "$R/runs.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='checkpoints' --exclude='model' \
  $(find . -name metrics.jsonl -o -name summary.json -o -name config.yaml | sort)) || true
ls -la "$R"
