#!/usr/bin/env bash
# Issue 14: what zero3_offload holds on the GPU at its peak, on 1 and on 2 ranks (benchmarks/diag/peak_snapshot.py,
# --markers: sizes only, DeepSpeed's phases marked), for the cells in $CELLS (model:ranks:limit_s), on a 2-GPU machine:
#   CELLS="bloom-3b:2:120 bloom-3b:1:120 bloom-7b1:2:130" bash benchmarks/diag/z3off/snapshots.sh
# One report per run in $OUT (<model>-d<ranks>.txt, rank 0's; rank 1's head goes to the log).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/diag
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)"; free -g | head -2; nproc
git log -1 --format='code %H' 2>/dev/null || true
# cpu_adam's first build takes ~60 s: beside the first model build (torch's extension lock makes the run wait for it)
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam prebuilt')" \
  > /tmp/prebuild.log 2>&1 &
CFG=benchmarks/diag/z3off/zero3-offload.yaml
STEPS=${STEPS:-2}
for cell in ${CELLS:-bloom-3b:2:120 bloom-3b:1:120 bloom-7b1:2:130}; do
  IFS=: read -r model d limit <<< "$cell"
  {
    echo "=== $model on $d rank(s), limit ${limit}s"; start=$SECONDS
    if [[ $d == 1 ]]; then
      SNAP_OUTPUT_DIR=/tmp/snap/$model-d1 timeout -k 10 $limit python3 benchmarks/diag/peak_snapshot.py $CFG --markers --recent 60 \
        --steps $STEPS --set model=$model --set gpus=1 > "$OUT/$model-d1.txt" 2>&1
      echo "rc=$? wall=$((SECONDS - start))s"; grep -m3 "max_memory_allocated\|replay freeing" "$OUT/$model-d1.txt"
    else
      rm -rf /tmp/tr-$model
      SNAP_OUTPUT_DIR=/tmp/snap/$model-d$d timeout -k 10 $limit torchrun --nproc-per-node $d --log-dir /tmp/tr-$model \
        --redirects 3 benchmarks/diag/peak_snapshot.py $CFG --markers --recent 60 --steps $STEPS --set model=$model --set gpus=$d
      echo "rc=$? wall=$((SECONDS - start))s"
      r0=$(find /tmp/tr-$model -path '*/0/stdout.log' | head -1); r1=$(find /tmp/tr-$model -path '*/1/stdout.log' | head -1)
      cat "$r0" $(find /tmp/tr-$model -path '*/0/stderr.log' | head -1) > "$OUT/$model-d$d.txt"
      [[ -n "$r1" ]] && grep -m3 "max_memory_allocated\|replay freeing" "$r1"
      grep -m3 "max_memory_allocated\|replay freeing" "$r0"
    fi
  }
done
ls -la "$OUT"
