#!/usr/bin/env bash
# loss_kernel=liger against the compiled loss and the bare compiled loop, in one H100 device call of at most ~9 minutes
# (carry the wheelhouse .whl, which holds liger-kernel 0.8.5; see benchmarks/build_wheelhouse.sh):
#   bash benchmarks/gpu_liger.sh
# 1. tests/test_loss_liger_gpu.py: Liger's real kernel against the fp64 reference, and dp training with it against the
#    model's own loss (fp32) and the compiled loss (bf16), on tiny-gpt2.
# 2. Interleaved repeats of: bare HF loop torch.compile (bare_reference.py), shardlab dp --compile with
#    loss_kernel=compiled, the same with loss_kernel=liger; gpt2-medium, seq 1024, bf16, micro 16, synthetic data, no
#    clipping, no eval (speed_gpu.py's *-noeval cells). Repeats go on while BUDGET_S lasts; the bare loop runs in the
#    first BARE_REPEATS of them.
# Results: $OUT/liger/{gpu.txt,log.txt,bare.jsonl,speed.json,speed.md,runs.tar.gz (metrics.jsonl, summary.json, config.yaml)}.
set -euo pipefail
OUT="${OUT:-/tmp/out}"; R="$OUT/liger"; mkdir -p "$R"
BUDGET_S="${BUDGET_S:-520}"; REPEATS="${REPEATS:-3}"; BARE_REPEATS="${BARE_REPEATS:-$REPEATS}"; RUNS=/tmp/shardlab-liger-runs
exec > >(tee -a "$R/log.txt") 2>&1
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
python3 -c "import torch, transformers, triton, liger_kernel, importlib.metadata as md; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'liger-kernel', md.version('liger-kernel'))" | tee -a "$R/gpu.txt"
left() { echo $(( BUDGET_S - SECONDS )); }
if [[ "${GPU_TESTS:-1}" == 1 ]]; then
  timeout 150 python3 -m pytest tests/test_loss_liger_gpu.py -q -p no:cacheprovider -W ignore || echo "GPU tests FAILED rc=$?"
fi
for rep in $(seq 1 "$REPEATS"); do
  echo "=== repeat $rep, $(left) s left"
  if (( rep <= BARE_REPEATS && $(left) > 90 )); then
    python3 benchmarks/bare_reference.py --all --modes compile-bf16 --warmup 5 --steps 20 --out "$R/bare.jsonl" --timeout 200 \
      || echo "bare FAILED"
  fi
  python3 benchmarks/speed_gpu.py --out "$R" --runs "$RUNS" --cells dp-compile-closs-noeval,dp-compile-liger-noeval \
    --steps 20 --budget-s "$(left)" --bare "$R/bare.jsonl" || echo "cells FAILED"
done
python3 benchmarks/speed_gpu.py --bare "$R/bare.jsonl" --out "$R" --cells "" --table-only
(cd "$RUNS" && tar -czf "$R/runs.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='checkpoints' --exclude='model' \
  $(find . -name metrics.jsonl -o -name summary.json -o -name config.yaml | sort)) || true
ls -la "$R"
