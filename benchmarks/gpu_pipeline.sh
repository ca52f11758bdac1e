#!/usr/bin/env bash
# One device call on a 4-GPU machine (issue 5): gpt2-large under pipeline parallelism (2 and 4 stages,
# gpipe and 1f1b, 8 micro-batches) next to ZeRO-2/3, FSDP and DDP at the same global batch (32 x 1024
# tokens), then the "pipeline vs ZeRO" page with measured vs simulated step time and bubble.
#   bash benchmarks/gpu_pipeline.sh          (repo root, GPU machine, .whl carried)
# Two-GPU runs go two at a time on GPU pairs {0,1} and {2,3}; the four-GPU runs one after another.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
MODEL="${MODEL:-gpt2-large}"; STEPS="${STEPS:-12}"; RUNS=/tmp/pp-runs
TOKENS=$(( (STEPS + 3) * 32 * 1024 * 11 / 10 ))
COMMON=(--model "$MODEL" --seq-len 1024 --precision bf16 --micro-batch 4 --global-batch 32 --max-steps "$STEPS"
        --dataset synthetic --set "dataset.synthetic_tokens=$TOKENS" --set dataset.eval_samples=8 --no-export --log-every 4)

run() {  # run LABEL GPUS-VISIBLE NGPUS ARGS...
  local label=$1 visible=$2 n=$3; shift 3
  echo "=== $label (GPUs $visible)"
  CUDA_VISIBLE_DEVICES=$visible timeout 200 python3 -m shardlab train "${COMMON[@]}" --gpus "$n" "$@" \
    --output-dir "$RUNS/$label" --overwrite > "$RUNS/$label.log" 2>&1
  echo "=== $label rc=$? $(grep -E 'tokens_per_s |gpu_mem_peak_gib|pipeline (step|bubble)|^error' "$RUNS/$label.log" | tr -s ' │' ' ' | tr '\n' ';')"
}
mkdir -p $RUNS
# 2 GPUs: two pairs at once
( run pp2-1f1b 0,1 2 --strategy pipeline --schedule 1f1b; run zero2-2gpu 0,1 2 --strategy zero2 ) &
( run pp2-gpipe 2,3 2 --strategy pipeline --schedule gpipe; run zero3-2gpu 2,3 2 --strategy zero3 ) &
wait
# 4 GPUs
run pp4-1f1b 0,1,2,3 4 --strategy pipeline --schedule 1f1b
run pp4-gpipe 0,1,2,3 4 --strategy pipeline --schedule gpipe
run zero2-4gpu 0,1,2,3 4 --strategy zero2
run zero3-4gpu 0,1,2,3 4 --strategy zero3
run fsdp-4gpu 0,1,2,3 4 --strategy fsdp
run dp-4gpu 0,1,2,3 4 --strategy dp
python3 benchmarks/pipeline_vs_zero.py $RUNS/pp2-1f1b $RUNS/pp2-gpipe $RUNS/zero2-2gpu $RUNS/zero3-2gpu $RUNS/pp4-1f1b \
  $RUNS/pp4-gpipe $RUNS/zero2-4gpu $RUNS/zero3-4gpu $RUNS/fsdp-4gpu $RUNS/dp-4gpu --out "$OUT/pipeline_vs_zero.md" --json "$OUT/rows.json"
for f in $RUNS/*.log; do echo "--- $f"; grep -E "error|Error|Traceback" "$f" | head -5; done
tail -n 30 $RUNS/pp4-1f1b.log
