#!/usr/bin/env bash
# Run a list of `shardlab train` cells on one GPU machine through the bench's runner (`shardlab bench --cells`: a fresh
# process per run, each line's own time limit and environment, failures recorded with their reason, finished runs kept
# when the same call is repeated) and bring back every run's summary.json, config and log in one tarball (device calls
# return at most 8 files):
#   CELLS_FILE=benchmarks/cells/<name>.txt bash benchmarks/gpu_cells.sh
# Each non-comment line of CELLS_FILE is "<label> <timeout_s> [VAR=value ...] <shardlab train flags...>"
# (src/shardlab/bench/cellfile.py). COMMON: flags added to every line. REPEATS (default 1) runs each line that many
# times, interleaved; BUDGET_S starts no run that would not end within it. The table at the end ($OUT/cells.md) is
# read from the runs' own summary.json; the bench's report goes to $OUT/report.md. SAVE_OPS=1 also saves DeepSpeed's
# JIT-built ops into $OUT (benchmarks/gpu_ops_cache.sh: copy the file into .whl/ and later calls restore it).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROOT="${ROOT:-/tmp/cells}"; mkdir -p "$ROOT"  # another ROOT keeps a second cells file's runs apart
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/diag
if [[ "${PREBUILD_CPU_ADAM:-0}" == 1 ]]; then
  # DeepSpeed's cpu_adam takes minutes to JIT-build on a fresh machine: start it now, beside the first cell's model
  # build (torch's extension loader holds a lock file, so the cell that needs it waits for this build, not a second one).
  python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam prebuilt')" \
    > "$ROOT/prebuild-cpu_adam.log" 2>&1 &
fi
free -g | head -2; nproc
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
ARGS=(--cells "$CELLS_FILE" --cell-flags "${COMMON:-}" --output-dir "$ROOT" --repeats "${REPEATS:-1}")
[[ "${REPEATS:-1}" != 1 ]] && ARGS+=(--interleave)
[[ -n "${BUDGET_S:-}" ]] && ARGS+=(--budget-s "$(( BUDGET_S - SECONDS - 30 ))")
python3 -m shardlab bench "${ARGS[@]}"
# profiled cells: where the step's time goes on the GPU (compute, NCCL, NCCL not hidden, idle), per rank
for t in "$ROOT"/runs/*/r*/profile/trace_rank*.json; do [[ -f "$t" ]] && python3 benchmarks/diag/trace_overlap.py "$t"; done
python3 benchmarks/cells_table.py "$ROOT" | tee "$OUT/cells.md"
[[ -f "$ROOT/report/report.md" ]] && cp "$ROOT/report/report.md" "$OUT/report.md"
[[ "${SAVE_OPS:-0}" == 1 ]] && bash benchmarks/gpu_ops_cache.sh save "$OUT"  # for .whl/: the next calls skip the builds
tar -czf "$OUT/cells.tar.gz" -C "$ROOT" --exclude='trace_rank*.json' --exclude='*.pt' --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.bin' .
ls -la "$OUT"
