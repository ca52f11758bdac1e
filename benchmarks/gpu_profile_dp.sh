#!/usr/bin/env bash
# One device call (issue 2): profile shardlab's dp step and the bare eager loop on the same GPU,
# and time the bare loop with each of shardlab's differences switched on alone.
#   bash benchmarks/gpu_profile_dp.sh        (repo root, GPU machine, .whl carried)
# Its one `shardlab train` is a single profiled run whose point is the trace (compared op by op with the bare loop's),
# not a list of cells, so it does not go through the bench's runner.
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
RUN=/tmp/shardlab-prof
python3 -m shardlab train --model gpt2-medium --seq-len 1024 --precision bf16 --strategy dp --micro-batch 8 \
  --grad-accum 1 --max-steps 30 --dataset synthetic --set dataset.synthetic_tokens=300000 --eval-split 0.02 \
  --set max_grad_norm=null --no-export --log-every 10 --profile --output-dir $RUN --overwrite
python3 - <<'PY'
import json; s = json.load(open("/tmp/shardlab-prof/summary.json"))
print("shardlab dp:", round(s["tokens_per_s"]), "tok/s, median step", round(s["step_time_median_s"] * 1e3, 2), "ms, min", round(s["step_time_min_s"] * 1e3, 2), "ms")
PY
for f in ops_rank0.json steps_rank0.json ops_rank0.txt; do cp $RUN/profile/$f "$OUT/shardlab_$f"; done
python3 benchmarks/profile_dp.py bare --out /tmp/bare-plain --label plain --results "$OUT/variants.jsonl"
for f in ops_rank0.json steps_rank0.json ops_rank0.txt; do cp /tmp/bare-plain/$f "$OUT/bare_$f"; done
python3 benchmarks/profile_dp.py compare /tmp/bare-plain $RUN/profile --top 30
for v in groups scheduler loader use-cache-off; do
  python3 benchmarks/profile_dp.py bare --out /tmp/bare-$v --label $v --$v --results "$OUT/variants.jsonl"
done
python3 benchmarks/profile_dp.py bare --out /tmp/bare-all --label all --groups --scheduler --loader --use-cache-off --results "$OUT/variants.jsonl"
python3 benchmarks/profile_dp.py bare --out /tmp/bare-plain2 --label plain-again --results "$OUT/variants.jsonl"
python3 benchmarks/profile_dp.py compare /tmp/bare-all $RUN/profile --top 20
cat "$OUT/variants.jsonl"
