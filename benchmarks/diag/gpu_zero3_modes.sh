set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
source benchmarks/gpu_env.sh
echo "cpu: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
M=none,all,foreach_norm,keep_gathered+foreach_norm,identity_reduce_scatter+foreach_norm,keep_gathered,identity_reduce_scatter
G="--device cuda --width 0 --seq-len 1024 --micro-batch 8 --precision bf16"
for r in 1 2; do
  python3 -c "import time; t = time.perf_counter(); sum(range(3_000_000)); print(f'cpu probe: {1e3 * (time.perf_counter() - t):.1f} ms')"
  python3 benchmarks/diag/host_overhead.py $G --strategy zero3 --steps 300 --warmup 6 --modes $M --period 4 --json $OUT/zero3-modes-$r.json 2>&1 | grep -E "median step|Error|Traceback|error"
  python3 benchmarks/diag/host_overhead.py $G --strategy dp --steps 60 --warmup 6 --json $OUT/dp-$r.json 2>&1 | grep -E "median step|Error|Traceback|error"
done
