#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2, `.whl` carried): gpt2-large as a 2-GPU pipeline under each
# schedule shardlab runs -- 1f1b, gpipe, interleaved-1f1b (2 chunks per GPU) and zbv (2 stages per GPU in a V, backward
# split into I and W) -- with the compute-balanced split (blocks plus the LM head weighed by HEAD_COST_FACTOR; the
# 2026-11-21 H200 runs predate it), 8 micro-batches of 4 x 1024 tokens, bf16. Prints, per run, the measured step time
# and bubble beside `shardlab pipeline simulate`'s (fed the run's own per-virtual-stage times) and the peak memory
# beside `shardlab plan`'s, then the same as $OUT/pipeline_schedules.md (+ rows.json; the bench directory with every
# run's summary, metrics and log in runs.tar.gz; log.txt).
#   bash benchmarks/gpu_pipeline_schedules.sh                       (repo root, on the GPU machine)
#   SCHEDULES="1f1b zbv" REPEATS=2 STEPS=16 bash benchmarks/gpu_pipeline_schedules.sh
# The runs are the cells of one bench (`shardlab bench --cells`, a file written here from SCHEDULES): a fresh process
# per run, each stopped after LIMIT seconds (default 240), failures recorded with their reason, finished runs kept (the
# same call on the same machine continues). REPEATS > 1 interleaves the schedules (a b c d a b c d): the host's speed
# drifts within a call. BUDGET_S: start no run that would not end within that many seconds of the script's start.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
python3 benchmarks/diag/zbv_torch_orders.py || echo "WARNING: this torch's zbv differs from pipesim's (above)"
MODEL="${MODEL:-gpt2-large}"; STEPS="${STEPS:-12}"; REPEATS="${REPEATS:-1}"; LIMIT="${LIMIT:-240}"
SCHEDULES="${SCHEDULES:-1f1b gpipe interleaved-1f1b zbv}"
RUNS=/tmp/pp-schedules; mkdir -p "$RUNS"
TOKENS=$(( (STEPS + 3) * 32 * 1024 * 11 / 10 ))
COMMON="--model $MODEL --seq-len 1024 --precision bf16 --micro-batch 4 --global-batch 32 --max-steps $STEPS
  --dataset synthetic --set dataset.synthetic_tokens=$TOKENS --eval-split 0 --no-export --log-every 4 --strategy pipeline --gpus 2"
for sched in $SCHEDULES; do
  extra=""; [[ "$sched" == interleaved-1f1b ]] && extra="--chunks 2"
  echo "pp2-$sched $LIMIT --schedule $sched $extra"
done > "$RUNS/cells.txt"
ARGS=(--cells "$RUNS/cells.txt" --cell-flags "$COMMON" --repeats "$REPEATS" --no-report --output-dir "$RUNS")
[[ "$REPEATS" -gt 1 ]] && ARGS+=(--interleave)
[[ -n "${BUDGET_S:-}" ]] && ARGS+=(--budget-s "$(( BUDGET_S - SECONDS > 1 ? BUDGET_S - SECONDS : 1 ))")
python3 -m shardlab bench "${ARGS[@]}"
dirs=()
for rep in $(seq 1 "$REPEATS"); do
  for sched in $SCHEDULES; do dirs+=("$RUNS/runs/pp2-$sched/r$rep"); done
done
python3 benchmarks/pipeline_schedules.py "${dirs[@]}" --out "$OUT/pipeline_schedules.md" --json "$OUT/rows.json"
tar -czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' .
ls -la "$OUT"
