#!/usr/bin/env bash
# One device call on one H200 (.whl carried): shardlab's LoRA against HF Trainer + peft (benchmarks/peer_lora.py) on
# the same model, micro-batch, sequence length, precision and adapter settings, interleaved (ROUNDS rounds); QLoRA of
# the same model at micro 1; a 70B-class architecture under QLoRA for 10 steps. Everything into $OUT: log.txt,
# cells.md (shardlab's runs, read from their summary.json), peers.md (the side by side) and adapters.tgz.
#   bash benchmarks/gpu_adapters.sh   # MODEL=llama-2-7b MICRO=8 STEPS=20 ROUNDS=2 BIG=llama-2-70b (empty: none)
#                                     # COMPILED=1: also a --compile LoRA run each round (first)
#                                     # BUDGET_S=540: the runs stop in time for the tables
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
R=/tmp/adapters; mkdir -p "$R"
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
# One GPU for every run, the peer included: on a machine with more, transformers.Trainer started without a launcher
# wraps the model in nn.DataParallel over all of them, and shardlab would start one rank per GPU.
export CUDA_VISIBLE_DEVICES="${GPU:-0}"
BUDGET_S="${BUDGET_S:-100000}"; MODEL="${MODEL:-llama-2-7b}"; MICRO="${MICRO:-8}"; STEPS="${STEPS:-20}"; ROUNDS="${ROUNDS:-2}"; BIG="${BIG-llama-2-70b}"
COMMON=(--gpus 1 --seq-len 1024 --precision bf16 --dataset synthetic --eval-split 0 --no-export --log-every 5)
train() {  # label, limit, flags...; each run's limit clamped to what is left of BUDGET_S (seconds, for the whole call)
  local label=$1 limit=$2; shift 2
  (( limit > BUDGET_S - SECONDS )) && limit=$(( BUDGET_S - SECONDS ))
  if (( limit < 30 )); then echo "=== $label: skipped, ${limit}s left of BUDGET_S"; return; fi
  echo "=== $label: shardlab train $* ${COMMON[*]}"
  timeout -k 5 "$limit" python3 -m shardlab train "$@" "${COMMON[@]}" --output-dir "$R/$label" > "$R/$label.log" 2>&1
  echo "rc=$?"; grep -E "trainable|start-up|step [0-9]+/|GPU memory.used|rror" "$R/$label.log" | cut -c1-240 | tail -8
}
for round in $(seq "$ROUNDS"); do
  if [[ "${COMPILED:-0}" == 1 ]]; then
    train "lora-compile-$round" "${TC:-200}" --model "$MODEL" --peft lora --micro-batch "$MICRO" --max-steps "$STEPS" --compile
  fi
  train "lora-$round" "${TL:-170}" --model "$MODEL" --peft lora --micro-batch "$MICRO" --max-steps "$STEPS" ${LORA_FLAGS:-}
  echo "=== peer-$round: benchmarks/peer_lora.py"
  (( BUDGET_S - SECONDS < 40 )) && { echo "skipped: budget"; continue; }
  timeout -k 5 "$(( ${TP:-170} < BUDGET_S - SECONDS ? ${TP:-170} : BUDGET_S - SECONDS ))" python3 benchmarks/peer_lora.py --model "$MODEL" --micro "$MICRO" --seq 1024 --steps "$STEPS" \
    --out "$R/peer-$round.json" > "$R/peer-$round.log" 2>&1
  echo "rc=$?"; tail -c 600 "$R/peer-$round.log"
done
train qlora "${TQ:-150}" --model "$MODEL" --peft qlora --micro-batch 1 --max-steps 10
# torchtune's and the QLoRA paper's recipe: activation checkpointing, without which a micro-batch's activations
# outweigh the 4-bit weights
train qlora-ckpt "${TQ:-150}" --model "$MODEL" --peft qlora --micro-batch 1 --max-steps 10 --gradient-checkpointing
[[ -n "$BIG" ]] && train "qlora-${BIG}" "${TB:-300}" --model "$BIG" --peft qlora --micro-batch 1 --max-steps 10 --log-every 1
python3 benchmarks/cells_table.py "$R" | tee "$OUT/cells.md"
python3 - "$R" <<'PY' | tee "$OUT/peers.md"
import json, statistics, sys
from pathlib import Path
r = Path(sys.argv[1])
ours = [json.loads(p.read_text()) for p in sorted(r.glob("lora-[0-9]*/summary.json"))]
compiled = [json.loads(p.read_text()) for p in sorted(r.glob("lora-compile-*/summary.json"))]
peers = [json.loads(p.read_text()) for p in sorted(r.glob("peer-*.json"))]
def med(xs):
    return statistics.median(xs) if xs else float("nan")
a = med([s.get("useful_tokens_per_s") or s.get("tokens_per_s") for s in ours])
b = med([p["tokens_per_s"] for p in peers])
print("| run | tok/s (median) | runs | GPU peak GiB |")
print("|---|---|---|---|")
print(f"| shardlab --peft lora | {a:,.0f} | {len(ours)} | {max((s.get('gpu_mem_peak_gib') or 0) for s in ours) if ours else '-'} |")
print(f"| HF Trainer + peft | {b:,.0f} | {len(peers)} | {max((p.get('peak_alloc_gib') or 0) for p in peers) if peers else '-'} |")
if compiled:
    c = med([s.get("useful_tokens_per_s") or s.get("tokens_per_s") for s in compiled])
    print(f"| shardlab --peft lora --compile | {c:,.0f} | {len(compiled)} | {max((s.get('gpu_mem_peak_gib') or 0) for s in compiled)} |")
    print(f"\nratio shardlab --compile / HF Trainer + peft: {c / b:.2f}x")
print(f"\nratio shardlab / HF Trainer + peft: {a / b:.2f}x")
PY
tar -czf "$OUT/adapters.tgz" -C "$R" --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.pt' --exclude='hf-peft-run' .
ls -la "$OUT"
