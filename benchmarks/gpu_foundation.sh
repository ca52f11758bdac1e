#!/usr/bin/env bash
# One device call: install the wheelhouse, then bare references and the shardlab cells compared
# with them, each pair in the same session on the same GPU. Usage (repo root, on the GPU machine):
#   bash benchmarks/gpu_foundation.sh "BARE_MODES" "SHARDLAB_CELLS"
#   e.g. bash benchmarks/gpu_foundation.sh eager-bf16,compile-bf16,ds-zero2 dp,dp-compile,zero2
# REPEATS=N alternates bare and shardlab N times (so drift of the GPU's clocks over the call hits
# both sides alike); the table gives medians over the repeats with their min-max.
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" | tee -a "$OUT/gpu.txt"
for rep in $(seq "${REPEATS:-1}"); do
  echo "=== repeat $rep"
  if [[ -n "${1:-}" ]]; then
    python3 benchmarks/bare_reference.py --all --modes "$1" --warmup 5 --steps 25 --out "$OUT/bare.jsonl"
  fi
  if [[ -n "${2:-}" ]]; then
    python3 benchmarks/foundation_gpu.py --bare "$OUT/bare.jsonl" --out "$OUT" --cells "$2" --steps 50
  fi
done
