#!/usr/bin/env bash
# Elastic resume on GPU (issue 6): gpt2-medium trained under ZeRO-3 on one GPU, checkpointed, resumed as
# ZeRO-2 (on 1 GPU, and on 2 GPUs when there are two), against an uninterrupted ZeRO-3 run with the same
# global batch. The lr is constant after warm-up: the first half stops at --max-steps HALF, and a decaying
# schedule would be sized to that half, not to the whole run. Writes $OUT/elastic-resume.{json,md}; copy them to benchmarks/results/.
# Not through the bench's runner (`shardlab bench --cells`): the resumed runs continue the first half's checkpoint in
# that run's own directory (--resume auto), and the runner gives every run a fresh directory of its own.
# Usage (repo root, on the GPU machine): OUT=/tmp/out bash benchmarks/gpu_elastic_resume.sh
set -euo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
PRECISION="${PRECISION:-bf16}"; STEPS="${STEPS:-40}"; HALF=$((STEPS / 2))
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")  # honours CUDA_VISIBLE_DEVICES
COMMON=(--model gpt2-medium --dataset offline --seq-len 1024 --global-batch 16 --micro-batch 8 --precision "$PRECISION"
        --dropout 0 --lr 1e-4 --warmup-steps 5 --lr-schedule constant --max-steps "$STEPS" --log-every 1 --no-export --seed 1)
R="$OUT/elastic"; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m shardlab train "${COMMON[@]}" --strategy zero3 --gpus 1 --output-dir "$R/zero3-straight" 2>&1 | tail -n 3
python3 -m shardlab train "${COMMON[@]}" --strategy zero3 --gpus 1 --max-steps "$HALF" --save-every "$HALF" --output-dir "$R/z3-then-z2-1gpu" 2>&1 | tail -n 3
[[ "$GPUS" -ge 2 ]] && cp -r "$R/z3-then-z2-1gpu" "$R/z3-then-z2-2gpu"
python3 -m shardlab train "${COMMON[@]}" --strategy zero2 --gpus 1 --resume auto --output-dir "$R/z3-then-z2-1gpu" 2>&1 | tail -n 3
if [[ "$GPUS" -ge 2 ]]; then
  python3 -m shardlab train "${COMMON[@]}" --strategy zero2 --gpus 2 --resume auto --output-dir "$R/z3-then-z2-2gpu" 2>&1 | tail -n 3
fi
python3 - "$R" "$HALF" "$OUT" "$PRECISION" <<'PY'
import json, sys
from pathlib import Path
root, half, out, precision = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
ref = losses(root / "zero3-straight")
result = {"model": "gpt2-medium", "precision": precision, "global_batch": 16, "resumed_at": half, "gpu": (out / "gpu.txt").read_text().strip(), "runs": {}}
lines = [f"# Elastic resume: gpt2-medium zero3 (1 GPU) -> zero2, {precision}, global batch 16, checkpoint at step {half}", "",
         "| run | steps compared | max rel. diff vs uninterrupted zero3 | first step after resume |", "|---|---|---|---|"]
for name in ("z3-then-z2-1gpu", "z3-then-z2-2gpu"):
    if not (root / name / "summary.json").is_file():
        continue
    got = losses(root / name)
    after = [s for s in sorted(got) if s > half]
    rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in after}
    world = json.loads((root / name / "summary.json").read_text())["world_size"]
    result["runs"][name] = {"world_size": world, "rel_diff": rel, "max_rel_diff": max(rel.values()), "losses": got, "reference": ref}
    lines.append(f"| {name} ({world} GPU) | {after[0]}-{after[-1]} | {max(rel.values()):.2e} | {rel[after[0]]:.2e} |")
(out / "elastic-resume.json").write_text(json.dumps(result, indent=1))
(out / "elastic-resume.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
