# The one environment of the GPU device scripts: every benchmarks/gpu_*.sh (and bench_gpu.sh, peers.sh,
# plan_validation.sh) sources it from the repository root, after its `exec > >(tee ...)` where it has one:
#   source benchmarks/gpu_env.sh
# 1. Installs the offline wheelhouse (.whl, carried) into /tmp/site with benchmarks/install_gpu_deps.sh, once per
#    machine: a second script on the same (still held) machine finds the same wheels recorded and skips it. A failed
#    install stops the script that sourced this file.
# 2. Exports what every shardlab / bare run there needs: this checkout's src/, the wheelhouse and benchmarks/ (the
#    scripts' helpers) on PYTHONPATH, unbuffered output, the H100/H200 arch for JIT builds, the offline hub, one
#    compile cache (SHARDLAB_CACHE: compiled graphs found again by a later run), and never NVLink multicast on
#    multi-GPU hosts (NCCL NVLS, symmetric-memory multicast and NVSHMEM NVLS off; nothing changes on one GPU).
# 3. Restores DeepSpeed's JIT-built ops from .whl/ when an earlier call saved them (benchmarks/gpu_ops_cache.sh).
# 4. Prints the GPUs and the torch / transformers versions into the log.
# A script adds its own extra paths after sourcing (e.g. gpu_cells.sh: benchmarks/diag).
_gpu_env_whl="${WHL:-$PWD/.whl}"
_gpu_env_stamp=/tmp/site/.shardlab-wheelhouse
if [[ -f "$_gpu_env_stamp" && "$(ls "$_gpu_env_whl" 2>/dev/null)" == "$(cat "$_gpu_env_stamp")" ]]; then
  echo "gpu_env: the wheelhouse in $_gpu_env_whl is already installed in /tmp/site"
else
  bash benchmarks/install_gpu_deps.sh >/dev/null || { echo "gpu_env: wheelhouse install FAILED" >&2; exit 1; }
  ls "$_gpu_env_whl" > "$_gpu_env_stamp"
fi
unset _gpu_env_whl _gpu_env_stamp
export PYTHONPATH=$PWD/src:/tmp/site:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export SHARDLAB_CACHE=/tmp/shardlab-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# DeepSpeed's ops built by an earlier call (benchmarks/gpu_ops_cache.sh): one build root, restored from .whl/ if there
export TORCH_EXTENSIONS_DIR=/tmp/torch-extensions
bash benchmarks/gpu_ops_cache.sh restore || echo "gpu_env: ops cache not restored (ops build when first needed)"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || echo "gpu_env: nvidia-smi FAILED"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
