#!/usr/bin/env bash
# Issue 12's bar for the crash-chain test: it passes N times in a row (default 20) while two other test
# processes load the machine. Each repeat is a fresh pytest of test_cluster.py's crash chain (rank 1 SIGKILLed
# in step 6 by a fault, resumed, SIGKILLed while the step-8 checkpoint is half-written, resumed to the end, and
# compared with the uninterrupted run), beside two loops of the fast tier's training tests.
#   bash benchmarks/crash_chain_under_load.sh [N] [RESULT_DIR]
# LOADS=k runs k load loops instead of 2 (e.g. 1 while a CI run on the same machine is the other test process).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N="${1:-20}"
OUT="${2:-benchmarks/results/$(date +%F)-cpu-crash-chain}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
load() {  # one loop of other test processes until the marker file goes away
  while [ -e "$OUT/.loading" ]; do "$PY" -m pytest -q -p no:cacheprovider tests/test_train_e2e.py -m "not slow" >/dev/null 2>&1; done
}
LOADS="${LOADS:-2}"
touch "$OUT/.loading"
PIDS=()
for _ in $(seq 1 "$LOADS"); do load & PIDS+=($!); done
{
  echo "# crash chain under load: $N repeats, $(date -Is)"
  echo "# host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load: $LOADS loop(s) of pytest tests/test_train_e2e.py -m 'not slow'${LOAD_NOTE:+; $LOAD_NOTE}"
  echo "# python: $("$PY" -c 'import torch, deepspeed, transformers; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__)')"
} > "$OUT/results.txt"
passed=0
for i in $(seq 1 "$N"); do
  t0=$(date +%s)
  if "$PY" -m pytest -q -p no:cacheprovider tests/test_cluster.py -k "kill9 or resumed_losses" > "$OUT/repeat-$i.log" 2>&1; then
    passed=$((passed + 1)); status=pass; rm -f "$OUT/repeat-$i.log"
  else
    status=FAIL
  fi
  echo "repeat $i: $status in $(( $(date +%s) - t0 )) s, load average $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT/results.txt"
  [ "$status" = pass ] || break
done
rm -f "$OUT/.loading"
kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null
echo "passed $passed of $N in a row" | tee -a "$OUT/results.txt"
[ "$passed" = "$N" ]
