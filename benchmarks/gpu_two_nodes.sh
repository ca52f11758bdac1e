#!/usr/bin/env bash
# Two nodes of one GPU each on localhost (NCCL) against one node of two GPUs: dp, fsdp, zero3, and fsdp over gloo on the
# CPU (tests/test_two_nodes_gpu.py). Needs 2 CUDA GPUs (the CUDA cases skip otherwise); carry the wheelhouse .whl:
#   bash benchmarks/gpu_two_nodes.sh
set -euo pipefail; source benchmarks/gpu_env.sh; python3 -m pytest tests/test_two_nodes_gpu.py -q -rs -p no:cacheprovider
