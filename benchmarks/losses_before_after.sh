#!/usr/bin/env bash
# Per-step losses of every single-rank CPU strategy from two source trees (issue 13: "the per-step losses of every
# strategy stay identical" across the restructuring). ao_offload needs a CUDA GPU and is refused on CPU.
#   git worktree add /tmp/before ea637e3
#   bash benchmarks/losses_before_after.sh /tmp/before/src $PWD/src /tmp/cmp
# then compare /tmp/cmp/{before,now}-<strategy>/metrics.jsonl (results: benchmarks/results/2026-11-25-cpu-losses-before-after/).
# Not through the bench's runner (`shardlab bench --cells`): each tree's `shardlab train` must read the flags itself,
# while the runner hands every run a config file written by the tree the bench runs from (and the older tree has no
# `bench --cells`). A CPU script: it sources no benchmarks/gpu_env.sh.
set -uo pipefail
BEFORE="$1"; NOW="$2"; OUT="${3:-/tmp/cmp}"; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
for s in dp zero0 zero1 zero2 zero3 zero2_offload zero3_offload fsdp fsdp_offload; do
  for v in before now; do
    src=$([ $v = before ] && echo "$BEFORE" || echo "$NOW")
    PYTHONPATH="$src" timeout 600 python -m shardlab train --model tiny-gpt2 --strategy $s --max-steps 5 --seq-len 64 \
      --micro-batch 2 --precision fp32 --dropout 0 --seed 1234 --lr 1e-3 --lr-schedule constant --log-every 1 \
      --set dataset.eval_samples=1 --set export=false --output-dir "$OUT/$v-$s" > "$OUT/$v-$s.log" 2>&1
    echo "$v $s rc=$?"
  done
done
