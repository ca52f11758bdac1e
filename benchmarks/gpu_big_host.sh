#!/usr/bin/env bash
# One device call (issue 14, items 1 and 5): host RAM and GPU peak of big-model offload runs beside what
# `shardlab plan` predicted for them. bloom-3b under zero2_offload / zero3_offload / fsdp_offload for a few
# steps, then, while the call's time allows, bloom-7b1 (zero2_offload is expected to be *refused* on a
# 125 GiB host with pinned buffers: the refusal line is recorded as its result).
#   bash benchmarks/gpu_big_host.sh              (repo root, GPU machine, .whl carried; one H100, <= 9 min)
#   BUDGET_S=500 STEPS=4 bash benchmarks/gpu_big_host.sh
# Results: $OUT/big_host.md (the table), $OUT/big_host.jsonl (one row per run), $OUT/logs/, runs' summaries.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/logs" "$OUT/summaries"
START=$(date +%s)
BUDGET_S="${BUDGET_S:-500}"   # stop starting new runs after this (the call's limit is 600 s of command time)
STEPS="${STEPS:-4}"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
free -g | tee "$OUT/free.txt"
nproc | tee "$OUT/nproc.txt"
: > "$OUT/big_host.jsonl"

run() {  # run NAME MODEL STRATEGY MICRO [extra train flags...]
  local name=$1 model=$2 strategy=$3 micro=$4; shift 4
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if (( left < 60 )); then echo "skip $name: ${left}s left of the budget" | tee -a "$OUT/skipped.txt"; return; fi
  local dir=/tmp/big-host/$name
  rm -rf "$dir"
  echo "== $name ($model $strategy micro $micro $*), ${left}s left"
  timeout $(( left - 10 )) python3 -m shardlab train --model "$model" --strategy "$strategy" --precision bf16 --seq-len 1024 \
    --micro-batch "$micro" --grad-accum 1 --max-steps "$STEPS" --dataset synthetic --set dataset.synthetic_tokens=200000 \
    --eval-split 0.02 --set eval_every=1000 --no-export --log-every 1 --output-dir "$dir" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  [[ -f $dir/summary.json ]] && cp "$dir/summary.json" "$OUT/summaries/$name.json"
  NAME=$name MODEL=$model STRATEGY=$strategy RC=$rc DIR=$dir LOG="$OUT/logs/$name.log" python3 - >> "$OUT/big_host.jsonl" <<'PY'
import json, os
from pathlib import Path
d = Path(os.environ["DIR"]); row = {k.lower(): os.environ[k] for k in ("NAME", "MODEL", "STRATEGY")}
row["rc"] = int(os.environ["RC"])
if (d / "summary.json").is_file():
    s = json.loads((d / "summary.json").read_text()); plan = s.get("plan") or {}
    row.update(plan_host_gib=plan.get("cpu_gib"), plan_gpu_gib=plan.get("gpu_peak_gib"),
               host_rank_gib=s.get("cpu_rss_max_rank_gib"),
               host_tree_gib=((s.get("cpu_monitor") or {}).get("real_mb") or {}).get("peak", 0) * 1e6 / 2**30 or None,
               gpu_gib=s.get("gpu_mem_peak_gib"), tok_s=s.get("tokens_per_s"), steps=s.get("steps"))
else:  # refused (the one-line UserError) or killed: keep the last lines
    row["tail"] = Path(os.environ["LOG"]).read_text(errors="replace").strip().splitlines()[-3:]
print(json.dumps(row))
PY
  tail -n 1 "$OUT/big_host.jsonl"
}

run b3-zero2  bloom-3b  zero2_offload 4 --gradient-checkpointing
run b3-zero3  bloom-3b  zero3_offload 4 --gradient-checkpointing
run b3-fsdp   bloom-3b  fsdp_offload  4 --gradient-checkpointing
run b7-zero2  bloom-7b1 zero2_offload 1 --gradient-checkpointing      # expected: refused before it starts
run b7-fsdp   bloom-7b1 fsdp_offload  1 --gradient-checkpointing
run b7-zero3  bloom-7b1 zero3_offload 1 --gradient-checkpointing

python3 - "$OUT" <<'PY' | tee "$OUT/big_host.md"
import json, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "big_host.jsonl").read_text().splitlines() if l.strip()]
f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
err = lambda p, m: "-" if p is None or not m else f"{(p - m) / m:+.1%}"  # noqa: E731
print("| run | model | strategy | plan host GiB | rank RSS peak GiB | err | process tree peak GiB | plan GPU GiB | GPU peak GiB | err | tok/s | result |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    result = "ok" if r["rc"] == 0 else ("refused/failed: " + " / ".join(r.get("tail", []))[-200:])
    print(f"| {r['name']} | {r['model']} | {r['strategy']} | {f(r.get('plan_host_gib'))} | {f(r.get('host_rank_gib'))} | "
          f"{err(r.get('plan_host_gib'), r.get('host_rank_gib'))} | {f(r.get('host_tree_gib'))} | {f(r.get('plan_gpu_gib'))} | "
          f"{f(r.get('gpu_gib'))} | {err(r.get('plan_gpu_gib'), r.get('gpu_gib'))} | {f(r.get('tok_s'))} | {result} |")
PY
