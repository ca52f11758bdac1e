#!/usr/bin/env bash
# Run a list of `shardlab train` cells one after another on one GPU machine, each under its own wall limit, and
# bring back every run's summary.json, config and log in one tarball (device calls return at most 8 files):
#   CELLS_FILE=benchmarks/cells/<name>.txt bash benchmarks/gpu_cells.sh
# Each non-comment line of CELLS_FILE is "<label> <timeout_s> [VAR=value ...] <shardlab train flags...>" (leading
# VAR=value words are set in that run's environment). Common flags: $COMMON.
# The table printed at the end (and saved as $OUT/cells.md) is read from the runs' own summary.json.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROOT=/tmp/cells; mkdir -p "$ROOT"
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/diag
if [[ "${PREBUILD_CPU_ADAM:-0}" == 1 ]]; then
  # DeepSpeed's cpu_adam takes minutes to JIT-build on a fresh machine: start it now, beside the first cell's model
  # build (torch's extension loader holds a lock file, so the cell that needs it waits for this build, not a second one).
  python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam prebuilt')" \
    > "$ROOT/prebuild-cpu_adam.log" 2>&1 &
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; free -g | head -2; nproc
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
grep -v '^\s*#' "$CELLS_FILE" | grep -v '^\s*$' | while read -r label limit flags; do
  echo "=== $label (limit ${limit}s): shardlab train $flags ${COMMON:-}"
  start=$SECONDS; envs=()
  read -r -a words <<< "$flags"
  while [[ ${#words[@]} -gt 0 && "${words[0]}" == *=* && "${words[0]}" != -* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" env "${envs[@]}" python3 -m shardlab train "${words[@]}" ${COMMON:-} --output-dir "$ROOT/$label" > "$ROOT/$label.log" 2>&1
  echo "rc=$? wall=$((SECONDS - start))s"; tail -n 25 "$ROOT/$label.log"
  # profiled cells: where the step's time goes on the GPU (compute, NCCL, NCCL not hidden, idle), per rank
  for t in "$ROOT/$label"/profile/trace_rank*.json; do [[ -f "$t" ]] && python3 benchmarks/diag/trace_overlap.py "$t"; done
done
python3 benchmarks/cells_table.py "$ROOT" | tee "$OUT/cells.md"
tar -czf "$OUT/cells.tar.gz" -C "$ROOT" --exclude='trace_rank*.json' --exclude='*.pt' --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.bin' .
ls -la "$OUT"
