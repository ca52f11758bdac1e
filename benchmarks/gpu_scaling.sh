#!/usr/bin/env bash
# Issue 38 item 4 on a multi-GPU machine: `shardlab bench --suite scaling` (weak scaling 1 -> N GPUs; gpt2-large,
# bloom-1b7, llama-3.2-1b x dp, zero1, zero2, zero3, fsdp x eager/compiled; 3 interleaved repeats), in device calls
# of limited length that continue one bench.
#   bash benchmarks/gpu_scaling.sh [BENCH_ARGS...]                       # N = the GPUs the machine has
#   e.g. (2 x H200)  BUDGET_S=540 bash benchmarks/gpu_scaling.sh --gpu-counts 1,2
#        a subset:   bash benchmarks/gpu_scaling.sh --gpu-counts 1,2 --models gpt2-large --strategies dp,zero2,fsdp
#        another suite (SUITE: a built-in name or a suite YAML; its parts named `scaling` make the report's table):
#                    SUITE=benchmarks/suites/scaling-bars.yaml bash benchmarks/gpu_scaling.sh --gpu-counts 1,2 --models bloom-1b7
# Modelled on bench_gpu.sh: the offline wheelhouse, never NVLink multicast, the bench directory in /tmp/bench/$NAME
# (NAME=scaling unless set) on the GPU machine, and in $OUT: $NAME.md (the report), $NAME.html (self-contained, the
# efficiency plot embedded), $NAME.tgz (bench.json, report/, every run's summary.json, config.yaml, metrics.jsonl,
# env.json, memory CSVs and the logs) and $NAME.log.
# Time: BUDGET_S (default 540) is the whole call, install included. The bench gets what is left of it less REPORT_S
# (default 40) for the report, as `--budget-s`: it starts a run only when the longest earlier run of that cell (else of
# any cell) would end within it, and --cell-timeout (default 300 s) bounds a run it started. Run the same command
# again on the same (still held) machine to continue: finished runs are kept; the interleaved order runs repeat 1 of
# every cell before any repeat 2, so a bench cut short still has every cell once.
# The whole suite is 60 cells x 3 repeats on 2 GPUs (a run: start-up ~15-30 s, compiled cells more, then 30 steps);
# expect several calls. The report of a partial bench says "k/3" repeats per GPU count.
set -euo pipefail
NAME="${NAME:-scaling}"; SUITE="${SUITE:-scaling}"  # SUITE: a built-in suite or a suite YAML
BUDGET_S="${BUDGET_S:-540}"; REPORT_S="${REPORT_S:-40}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/$NAME.gpu.txt"
nproc; free -g | head -2
BENCH=/tmp/bench/$NAME
LEFT=$(( BUDGET_S - SECONDS - REPORT_S ))
if (( LEFT < 60 )); then echo "only ${LEFT}s left of BUDGET_S=$BUDGET_S after the install: nothing started"; exit 1; fi
ARGS=("$@")
[[ " ${ARGS[*]-} " == *" --cell-timeout "* ]] || ARGS+=(--cell-timeout 300)
echo "bench budget: ${LEFT}s"
set +e
python3 -m shardlab bench --suite "$SUITE" --output-dir "$BENCH" --budget-s "$LEFT" "${ARGS[@]}" 2>&1 | tee "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
set -e
if [[ -d "$BENCH/report" ]]; then
  cp "$BENCH/report/report.md" "$OUT/$NAME.md"
  cp "$BENCH/report/report.html" "$OUT/$NAME.html"
  sed -n '/^### Weak scaling, 1/,/^- Useful tok/p' "$BENCH/report/report.md"   # the scaling tables, in the call's output
fi
if [[ -d "$BENCH" ]]; then  # whatever exists, also after a bench cut short
  (cd "$BENCH" && tar czf "$OUT/$NAME.tgz" $(ls -d bench.json cells logs report 2>/dev/null) \
     $(find runs -maxdepth 3 \( -name summary.json -o -name config.yaml -o -name metrics.jsonl -o -name env.json \
                                -o -name gpu_memory.csv -o -name cpu_memory.csv \) 2>/dev/null)) || true
fi
ls -la "$OUT"
exit "$rc"
