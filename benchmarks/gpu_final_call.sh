#!/usr/bin/env bash
# One 2 x H200 call (.whl carried): bloom-7b1 under fsdp on 2 GPUs (host memory of the module-by-module build, GPU peak
# against the plan), two nodes of one GPU each against one node of two (fsdp over NCCL), and gpt2-large's pipeline
# under 1f1b and zbv against the simulator. Each part under its own time limit; everything into $OUT:
# fsdp7b.{log,md} (the run's log and its row of benchmarks/cells_table.py), two-nodes.log, and what
# gpu_pipeline_schedules.sh brings back (pipeline_schedules.md, rows.json, runs.tar.gz, log.txt); env.txt.
#   bash benchmarks/gpu_final_call.sh          # T7B=140 TNODES=90 TPIPE=70 (seconds per part / per pipeline run)
# The fsdp run is a cell of `shardlab bench --cells` (the bench's runner: its own time limit, the failure's reason
# recorded); the two-node part is a pytest call (tests/test_two_nodes_gpu.py starts its own nodes), not a cells list.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh > "$OUT/env.txt" 2>&1
B=/tmp/final; mkdir -p "$B"
echo "fsdp-bloom7b1-2gpu ${T7B:-140} --model bloom-7b1 --strategy fsdp --gpus 2 --micro-batch 8 --seq-len 1024 --precision bf16" \
  "--gradient-checkpointing --max-steps 6 --dataset synthetic --eval-split 0 --no-export --log-every 3" > "$B/fsdp7b-cells.txt"
python3 -m shardlab bench --cells "$B/fsdp7b-cells.txt" --no-report --output-dir "$B"
cp "$B/logs/fsdp-bloom7b1-2gpu-r1.log" "$OUT/fsdp7b.log" || : > "$OUT/fsdp7b.log"
grep -E "start-up|step [0-9]|process tree|error" "$OUT/fsdp7b.log" | cut -c1-220
python3 benchmarks/cells_table.py "$B" | tee "$OUT/fsdp7b.md"
timeout -k 5 "${TNODES:-90}" python3 -m pytest tests/test_two_nodes_gpu.py -q -rs -p no:cacheprovider -k cuda-fsdp > "$OUT/two-nodes.log" 2>&1
echo "two nodes rc=$?"; tail -5 "$OUT/two-nodes.log"
# A budget rather than an outer `timeout`: the bench's runs are process groups of their own, which a timeout that ends
# the bench would leave running.
SCHEDULES="1f1b zbv" STEPS=12 LIMIT="${TPIPE:-70}" BUDGET_S=160 bash benchmarks/gpu_pipeline_schedules.sh > /dev/null 2>&1
echo "pipeline rc=$?"; cat "$OUT/pipeline_schedules.md" 2>/dev/null | head -30
