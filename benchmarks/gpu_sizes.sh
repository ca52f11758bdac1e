#!/usr/bin/env bash
# Issue 15: "gpt2 and gpt2-large reported too": shardlab dp --compile against the bare compiled loop (bare_reference.py)
# at other GPT-2 sizes, same micro batch, seq 1024, bf16, synthetic tokens, no clipping; one device call (carry: [".whl"]):
#   SIZES="gpt2:16 large:16" bash benchmarks/gpu_sizes.sh        # REPEATS=1, T=300 seconds per shardlab run
# Per size: the bare loop (20 steps after 5 warm-up) then shardlab (20 steps; steady-state median), REPEATS times
# interleaved. Each size's shardlab runs are one cell of its own bench (`shardlab bench --cells`, a one-line file written
# here, into /tmp/sizes/MODEL: a fresh process per run, its own time limit, failures recorded with their reason), continued
# with one more repeat each round (the repeats finished in this call are kept).
# Results: $OUT/sizes/{log.txt,bare.jsonl,shardlab.jsonl,sizes.md}.
set -euo pipefail
OUT="${OUT:-/tmp/out}"; R="$OUT/sizes"; mkdir -p "$R"; REPEATS="${REPEATS:-1}"
exec > >(tee -a "$R/log.txt") 2>&1
source benchmarks/gpu_env.sh
rm -rf /tmp/sizes  # each shardlab run beside the bare one of its round: none kept from an earlier call
for rep in $(seq 1 "$REPEATS"); do
  for sm in ${SIZES:-gpt2:16 large:16}; do
    size=${sm%%:*}; micro=${sm##*:}; model=gpt2; [[ $size != gpt2 ]] && model=gpt2-$size
    echo "=== $model micro $micro repeat $rep ($SECONDS s)"
    python3 benchmarks/bare_reference.py --all --modes "compile-bf16:$micro" --model-size "$size" --warmup 5 --steps 20 \
      --out "$R/bare.jsonl" --timeout 300 | grep -v "^{" || echo "bare FAILED"
    tokens=$(( 22 * micro * 1024 * 108 / 100 ))
    B="/tmp/sizes/$model"; mkdir -p "$B"
    echo "$model ${T:-300} --model $model --seq-len 1024 --precision bf16 --strategy dp --micro-batch $micro --grad-accum 1" \
      "--max-steps 20 --dataset synthetic --set dataset.synthetic_tokens=$tokens --eval-split 0.02 --set max_grad_norm=null" \
      "--no-export --log-every 10 --compile" > "$B/cells.txt"
    python3 -m shardlab bench --cells "$B/cells.txt" --repeats "$rep" --no-report --output-dir "$B"
    run="$B/runs/$model/r$rep"
    [[ -f "$run/summary.json" ]] || { echo "$model FAILED"; tail -5 "$B/logs/$model-r$rep.log" || true; continue; }
    python3 -c "
import json, sys; s = json.load(open(sys.argv[1])); p = s.get('plan') or {}
keep = ('model', 'micro_batch', 'tokens_per_s', 'mfu', 'gpu_mem_peak_gib', 'compile_time_s', 'time_to_first_step_s', 'device_name')
print(json.dumps({**{k: s.get(k) for k in keep}, 'planned_gpu_peak_gib': p.get('gpu_peak_gib')}))" "$run/summary.json" | tee -a "$R/shardlab.jsonl"
  done
done
python3 - "$R" <<'PY' | tee "$R/sizes.md"
import json, statistics, sys
from pathlib import Path
r = Path(sys.argv[1])
bare = [json.loads(l) for l in (r / "bare.jsonl").read_text().splitlines() if l.strip()] if (r / "bare.jsonl").exists() else []
ours = [json.loads(l) for l in (r / "shardlab.jsonl").read_text().splitlines() if l.strip()] if (r / "shardlab.jsonl").exists() else []
print("| model | micro | bare compiled tok/s | shardlab dp --compile tok/s | ratio | MFU | peak GiB (planned) | compile_time_s |")
print("|---|---|---|---|---|---|---|---|")
for model in dict.fromkeys(o["model"] for o in ours):
    mine = [o for o in ours if o["model"] == model]
    b = [x["tokens_per_s_median"] for x in bare if x.get("model") == model and x.get("micro") == mine[0]["micro_batch"]]
    t = statistics.median(o["tokens_per_s"] for o in mine); bt = statistics.median(b) if b else None
    ratio = f"{t / bt:.3f}" if bt else "-"
    print(f"| {model} | {mine[0]['micro_batch']} | {bt:,.0f} | {t:,.0f} ({len(mine)} runs) | {ratio} | {mine[-1]['mfu']:.1%} | "
          f"{mine[-1]['gpu_mem_peak_gib']:.2f} ({mine[-1]['planned_gpu_peak_gib']}) | {mine[-1]['compile_time_s']:.0f} |" if bt else
          f"| {model} | {mine[0]['micro_batch']} | - | {t:,.0f} | - | | | |")
PY
