#!/usr/bin/env bash
# One device call on a 4-GPU machine, four independent single-GPU jobs side by side (session 2):
#   GPU 0  shardlab bench --suite strategies (gpt2-medium: every strategy + the fp32 dp row)
#   GPU 1  benchmarks/plan_validation.py (predicted vs measured peak memory, --micro-batch auto check)
#   GPU 2  shardlab bench --suite pin-memory, then --suite offload (bloom-560m)
#   GPU 3  benchmarks/peers.py (shardlab zero2 vs HF Trainer + DeepSpeed JSON vs the bare loop)
# Each job has its own wall-clock cap so that all of them write their results before the call ends.
#   bash benchmarks/gpu_four_jobs.sh      (repo root, GPU machine, .whl carried)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
CAP="${CAP:-500}"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
B=/tmp/bench; mkdir -p $B
(
  CUDA_VISIBLE_DEVICES=0 timeout $CAP python3 -m shardlab bench --suite strategies --max-steps 30 --output-dir $B/strategies > $B/strategies.log 2>&1
  python3 -m shardlab report $B/strategies >> $B/strategies.log 2>&1
  echo "[strategies] done"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout $CAP python3 benchmarks/plan_validation.py --out $B/plan --runs /tmp/plan-runs --budget-min $(( CAP / 60 - 1 )) > $B/plan.log 2>&1
  echo "[plan] done"
) &
(
  CUDA_VISIBLE_DEVICES=2 timeout $(( CAP / 2 )) python3 -m shardlab bench --suite pin-memory --max-steps 15 --output-dir $B/pin-memory > $B/pin.log 2>&1
  python3 -m shardlab report $B/pin-memory >> $B/pin.log 2>&1
  CUDA_VISIBLE_DEVICES=2 timeout $(( CAP / 2 )) python3 -m shardlab bench --suite offload --max-steps 15 --output-dir $B/offload >> $B/pin.log 2>&1
  python3 -m shardlab report $B/offload >> $B/pin.log 2>&1
  echo "[pin/offload] done"
) &
(
  CUDA_VISIBLE_DEVICES=3 timeout $CAP python3 benchmarks/peers.py --model gpt2-medium --strategy zero2 --steps 30 --out $B/peers > $B/peers.log 2>&1
  echo "[peers] done"
) &
wait
cd $B
for d in strategies pin-memory offload; do
  [[ -f $d/report/report.md ]] && cp $d/report/report.md "$OUT/$d.md"
done
tar czf "$OUT/results.tgz" *.log $(ls -d strategies/report pin-memory/report offload/report plan peers strategies/bench.json pin-memory/bench.json offload/bench.json 2>/dev/null) \
  $(find strategies pin-memory offload peers -maxdepth 4 \( -name summary.json -o -name config.yaml -o -name gpu_memory.csv -o -name cpu_memory.csv -o -name metrics.jsonl \) 2>/dev/null) 2>/dev/null
ls -la "$OUT"; tail -n 5 *.log
cat "$OUT"/strategies.md 2>/dev/null | head -40
