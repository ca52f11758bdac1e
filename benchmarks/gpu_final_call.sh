#!/usr/bin/env bash
# One 2 x H200 call (.whl carried): bloom-7b1 under fsdp on 2 GPUs (host memory of the module-by-module build, GPU peak
# against the plan), two nodes of one GPU each against one node of two (fsdp over NCCL), and gpt2-large's pipeline
# under 1f1b and zbv against the simulator. Each part under its own time limit; everything into $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh > "$OUT/env.txt" 2>&1
mkdir -p /tmp/final
timeout -k 5 "${T7B:-140}" python3 -m shardlab train --model bloom-7b1 --strategy fsdp --gpus 2 --micro-batch 8 \
  --seq-len 1024 --precision bf16 --gradient-checkpointing --max-steps 6 --dataset synthetic --eval-split 0 --no-export \
  --log-every 3 --output-dir /tmp/final/fsdp-bloom7b1-2gpu > "$OUT/fsdp7b.log" 2>&1
echo "fsdp 7b rc=$?"; grep -E "start-up|step [0-9]|process tree|error" "$OUT/fsdp7b.log" | cut -c1-220
python3 benchmarks/cells_table.py /tmp/final | tee "$OUT/fsdp7b.md"
timeout -k 5 "${TNODES:-90}" python3 -m pytest tests/test_two_nodes_gpu.py -q -rs -p no:cacheprovider -k cuda-fsdp > "$OUT/two-nodes.log" 2>&1
echo "two nodes rc=$?"; tail -5 "$OUT/two-nodes.log"
SCHEDULES="1f1b zbv" STEPS=12 LIMIT="${TPIPE:-70}" timeout -k 5 160 bash benchmarks/gpu_pipeline_schedules.sh > /dev/null 2>&1
echo "pipeline rc=$?"; cat "$OUT/pipeline_schedules.md" 2>/dev/null | head -30
