#!/usr/bin/env bash
# One device call on a 4-GPU machine (issue 5): gpt2-large under pipeline parallelism (2 and 4 stages,
# gpipe and 1f1b, 8 micro-batches) next to ZeRO-2/3, FSDP and DDP at the same global batch (32 x 1024
# tokens), then the "pipeline vs ZeRO" page with measured vs simulated step time and bubble.
#   bash benchmarks/gpu_pipeline.sh          (repo root, GPU machine, .whl carried; MODEL=gpt2-large STEPS=12 T=200)
# The runs are cells of `shardlab bench --cells` (files written here; a fresh process per run, each stopped after T
# seconds, failures recorded with their reason, finished runs kept): the two-GPU runs as two benches at once, one on
# GPUs 0,1 and one on GPUs 2,3 (CUDA_VISIBLE_DEVICES in their lines), then the four-GPU runs as a third, one after
# another. Results: $OUT/pipeline_vs_zero.md and $OUT/rows.json; the bench directories are under /tmp/pp-runs.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
MODEL="${MODEL:-gpt2-large}"; STEPS="${STEPS:-12}"; T="${T:-200}"; RUNS=/tmp/pp-runs
TOKENS=$(( (STEPS + 3) * 32 * 1024 * 11 / 10 ))
COMMON="--model $MODEL --seq-len 1024 --precision bf16 --micro-batch 4 --global-batch 32 --max-steps $STEPS
  --dataset synthetic --set dataset.synthetic_tokens=$TOKENS --set dataset.eval_samples=8 --no-export --log-every 4"
mkdir -p $RUNS
cat > $RUNS/gpus01.txt <<CELLS
pp2-1f1b   $T CUDA_VISIBLE_DEVICES=0,1 --gpus 2 --strategy pipeline --schedule 1f1b
zero2-2gpu $T CUDA_VISIBLE_DEVICES=0,1 --gpus 2 --strategy zero2
CELLS
cat > $RUNS/gpus23.txt <<CELLS
pp2-gpipe  $T CUDA_VISIBLE_DEVICES=2,3 --gpus 2 --strategy pipeline --schedule gpipe
zero3-2gpu $T CUDA_VISIBLE_DEVICES=2,3 --gpus 2 --strategy zero3
CELLS
cat > $RUNS/gpus0123.txt <<CELLS
pp4-1f1b   $T CUDA_VISIBLE_DEVICES=0,1,2,3 --gpus 4 --strategy pipeline --schedule 1f1b
pp4-gpipe  $T CUDA_VISIBLE_DEVICES=0,1,2,3 --gpus 4 --strategy pipeline --schedule gpipe
zero2-4gpu $T CUDA_VISIBLE_DEVICES=0,1,2,3 --gpus 4 --strategy zero2
zero3-4gpu $T CUDA_VISIBLE_DEVICES=0,1,2,3 --gpus 4 --strategy zero3
fsdp-4gpu  $T CUDA_VISIBLE_DEVICES=0,1,2,3 --gpus 4 --strategy fsdp
dp-4gpu    $T CUDA_VISIBLE_DEVICES=0,1,2,3 --gpus 4 --strategy dp
CELLS
bench() {  # bench NAME: the cells of $RUNS/NAME.txt into the bench directory $RUNS/NAME
  python3 -m shardlab bench --cells "$RUNS/$1.txt" --cell-flags "$COMMON" --no-report --output-dir "$RUNS/$1"
}
# 2 GPUs: two pairs at once
bench gpus01 &
bench gpus23 &
wait
# 4 GPUs
bench gpus0123
python3 benchmarks/pipeline_vs_zero.py $RUNS/gpus01/runs/pp2-1f1b/r1 $RUNS/gpus23/runs/pp2-gpipe/r1 $RUNS/gpus01/runs/zero2-2gpu/r1 \
  $RUNS/gpus23/runs/zero3-2gpu/r1 $RUNS/gpus0123/runs/{pp4-1f1b,pp4-gpipe,zero2-4gpu,zero3-4gpu,fsdp-4gpu,dp-4gpu}/r1 \
  --out "$OUT/pipeline_vs_zero.md" --json "$OUT/rows.json"
for f in $RUNS/gpus*/logs/*.log; do echo "--- $f"; grep -E "error|Error|Traceback" "$f" | head -5; done
tail -n 30 $RUNS/gpus0123/logs/pp4-1f1b-r1.log
