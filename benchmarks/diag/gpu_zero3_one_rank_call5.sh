set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/diag
echo "cpu: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
R=benchmarks/results/2026-11-27-h100-zero3-one-rank
python3 -c "import time; t = time.perf_counter(); sum(range(3_000_000)); print(f'cpu probe: {1e3 * (time.perf_counter() - t):.1f} ms')"
python3 benchmarks/diag/host_overhead.py --device cuda --width 0 --seq-len 1024 --micro-batch 8 --precision bf16 --strategy zero3 --steps 300 --warmup 6 \
  --modes none,all,foreach_norm,keep_gathered+foreach_norm,identity_reduce_scatter+foreach_norm,keep_gathered,identity_reduce_scatter --period 4 --json $OUT/zero3-modes.json 2>&1 | grep -E "median step|Error|Traceback|error"
python3 -c "import time; t = time.perf_counter(); sum(range(3_000_000)); print(f'cpu probe: {1e3 * (time.perf_counter() - t):.1f} ms')"
for s in zero3 dp; do
  echo "=== peak snapshot: gpt2 fp32 $s (z3-fp32's configuration)"
  python3 benchmarks/diag/peak_snapshot.py $R/call4/z3-fp32-config.yaml --innermost --steps 3 --top 25 --set strategy=$s --set output_dir=/tmp/snap-$s 2>&1 | grep -v "^\[rank\|Warning\|warn" | tail -45
done
