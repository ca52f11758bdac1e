#!/usr/bin/env bash
# Issue 15 (speed) in one H100 device call of at most ~9 minutes (carry: [".whl"]):
#   bash benchmarks/gpu_speed.sh
# seq 1024, bf16, synthetic packed data. Bare reference first (bare_reference.py, same session), then the
# shardlab cells in priority order until BUDGET_S is spent (cells that would not fit are printed as skipped:
# run them in a second call with CELLS=... BARE=...). Each cell's row: tokens/s, MFU, peak GiB, the plan's
# predicted peak beside it, the run's own compile_time_s / time_to_first_step_s / compile cache hit.
#   bloom-sdpa / bloom-eager   bloom-560m dp micro 8: shardlab's ALiBi SDPA attention vs transformers' eager
#   dp-compile (+ -again)      gpt2-medium dp --compile micro 16 vs bare compiled; -again: same config, warm cache
#   zero3, zero1, zero2, dp    eager micro 8 (dp is the reference of the ZeRO ratios)
#   fsdp-compile               fsdp --compile micro 16 vs dp-compile
# REPEATS=N repeats the bloom pair (interleaved) when time is left. Results: $OUT/speed/{gpu.txt,bare.jsonl,
# speed.json,speed.md,log.txt} (five files; run directories stay on the machine).
set -euo pipefail
OUT="${OUT:-/tmp/out}"; R="$OUT/speed"; mkdir -p "$R"
BUDGET_S="${BUDGET_S:-530}"
CELLS="${CELLS:-bloom-sdpa,bloom-eager,dp-compile,dp-compile-again,zero3,zero1,zero2,dp,fsdp-compile}"
BARE="${BARE-compile-bf16}"
exec > >(tee -a "$R/log.txt") 2>&1
source benchmarks/gpu_env.sh  # SHARDLAB_CACHE: compiled graphs land in $SHARDLAB_CACHE/inductor (dp-compile-again reads them)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" | tee -a "$R/gpu.txt"
left() { echo $(( BUDGET_S - SECONDS )); }
if [[ -n "$BARE" ]]; then
  python3 benchmarks/bare_reference.py --all --modes "$BARE" --warmup 5 --steps 20 --out "$R/bare.jsonl"
fi
python3 benchmarks/speed_gpu.py --bare "$R/bare.jsonl" --out "$R" --cells "$CELLS" --steps 20 --budget-s "$(left)"
for rep in $(seq 2 "${REPEATS:-3}"); do
  python3 benchmarks/speed_gpu.py --bare "$R/bare.jsonl" --out "$R" --cells bloom-sdpa,bloom-eager --steps 20 --budget-s "$(left)"
done
python3 benchmarks/speed_gpu.py --bare "$R/bare.jsonl" --out "$R" --cells "" --table-only
