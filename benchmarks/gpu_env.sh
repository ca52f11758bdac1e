# Sourced by the GPU device scripts (after their `exec > >(tee ...)`): installs the wheelhouse (.whl, carried) quietly,
# sets the environment every shardlab / bare run there needs, and prints the device and the versions into the log.
bash benchmarks/install_gpu_deps.sh >/dev/null
export PYTHONPATH=$PWD/src:/tmp/site:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export SHARDLAB_CACHE=/tmp/shardlab-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
