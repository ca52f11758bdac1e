#!/usr/bin/env bash
# One device call: `shardlab plan` predicted vs measured peak memory over the validation grid
# (gpt2, gpt2-medium, gpt2-large, bloom-560m x seq 512, 1024 x dp, zero1-3, zero2/3_offload, fsdp) and the
# `--micro-batch auto` check. Usage (repo root, on the GPU machine, .whl carried):
#   bash benchmarks/plan_validation.sh [extra plan_validation.py flags, e.g. --models gpt2 --jobs 3]
# Results: $OUT/plan_validation.md and .json (copy them to benchmarks/results/h100-plan-validation/).
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/plan_validation.py --out "$OUT" --runs /tmp/plan-runs "$@" 2>&1 | tee "$OUT/plan_validation.log"
