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
# shardlab's runs are cells of one bench (`shardlab bench --cells`, the runner of every bench: a fresh process per run,
# its own limit, failures recorded, finished runs kept); a round is that bench continued with one more repeat.
COMMON="--gpus 1 --seq-len 1024 --precision bf16 --dataset synthetic --eval-split 0 --no-export --log-every 5"
{
  [[ "${COMPILED:-0}" == 1 ]] && echo "lora-compile ${TC:-200} --model $MODEL --peft lora --micro-batch $MICRO --max-steps $STEPS --compile"
  echo "lora ${TL:-170} --model $MODEL --peft lora --micro-batch $MICRO --max-steps $STEPS ${LORA_FLAGS:-}"
} > "$R/lora-cells.txt"
{
  echo "qlora ${TQ:-150} --model $MODEL --peft qlora --micro-batch 1 --max-steps 10"
  # torchtune's and the QLoRA paper's recipe: activation checkpointing, without which a micro-batch's activations
  # outweigh the 4-bit weights
  echo "qlora-ckpt ${TQ:-150} --model $MODEL --peft qlora --micro-batch 1 --max-steps 10 --gradient-checkpointing"
  [[ -n "$BIG" ]] && echo "qlora-${BIG} ${TB:-300} --model $BIG --peft qlora --micro-batch 1 --max-steps 10 --log-every 1"
} > "$R/qlora-cells.txt"
cells() {  # cells file, repeats: the bench's runs, none started that would not end within what is left of BUDGET_S
  local left=$(( BUDGET_S - SECONDS ))
  if (( left < 30 )); then echo "=== $1 x$2: skipped, ${left}s left of BUDGET_S"; return; fi
  python3 -m shardlab bench --cells "$1" --cell-flags "$COMMON" --repeats "$2" --budget-s "$left" --no-report --output-dir "$R/bench-$(basename "$1" .txt)"
}
for round in $(seq "$ROUNDS"); do
  cells "$R/lora-cells.txt" "$round"
  echo "=== peer-$round: benchmarks/peer_lora.py"
  (( BUDGET_S - SECONDS < 40 )) && { echo "skipped: budget"; continue; }
  timeout -k 5 "$(( ${TP:-170} < BUDGET_S - SECONDS ? ${TP:-170} : BUDGET_S - SECONDS ))" python3 benchmarks/peer_lora.py --model "$MODEL" --micro "$MICRO" --seq 1024 --steps "$STEPS" \
    --out "$R/peer-$round.json" > "$R/peer-$round.log" 2>&1
  echo "rc=$?"; tail -c 600 "$R/peer-$round.log"
done
cells "$R/qlora-cells.txt" 1
{ python3 benchmarks/cells_table.py "$R/bench-lora-cells"; python3 benchmarks/cells_table.py "$R/bench-qlora-cells" | tail -n +3; } | tee "$OUT/cells.md"
python3 - "$R" <<'PY' | tee "$OUT/peers.md"
import json, statistics, sys
from pathlib import Path
r = Path(sys.argv[1])
ours = [json.loads(p.read_text()) for p in sorted(r.glob("bench-lora-cells/runs/lora/r*/summary.json"))]
compiled = [json.loads(p.read_text()) for p in sorted(r.glob("bench-lora-cells/runs/lora-compile/r*/summary.json"))]
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
