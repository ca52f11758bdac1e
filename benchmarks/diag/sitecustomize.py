"""Diagnostic switches for benchmark runs only (benchmarks/gpu_cells.sh puts this folder on PYTHONPATH; every
process of a run, workers included, imports it at start-up). Nothing happens unless a variable below is set.

SHARDLAB_DIAG_NO_META=1  fsdp builds the ordinary (materialised) model instead of sharding on the meta device,
                         to compare the two builds' training speed.
SHARDLAB_DIAG_NO_CUDNN_SDP=1  torch.backends.cuda.enable_cudnn_sdp(False) in every process, and the SDPA priority
                         order printed once: DeepCompile (ZeRO-3) failed in inductor's code for the cuDNN attention
                         op (benchmarks/results/2026-11-26-h100-speed, calls 7-8)."""

import os

if os.environ.get("SHARDLAB_DIAG_NO_META"):
    import shardlab.training.models as _models

    _models.meta_loadable = lambda cfg: False

if os.environ.get("SHARDLAB_DIAG_NO_CUDNN_SDP"):
    import sys

    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    print(f"[diag] cuDNN SDPA off; priority order {torch._C._get_sdp_priority_order()}", file=sys.stderr)

if os.environ.get("SHARDLAB_DIAG_DDP_ONE_RANK"):
    import dataclasses

    import shardlab.strategies.ddp as _ddp

    _ddp_setup = _ddp.DDPStrategy.setup

    def _setup_with_ddp(self, model, total_steps):
        env = self.env
        always = type("DistributedEnv", (type(env),), {"is_distributed": property(lambda _: True)})
        self.env = always(**{f.name: getattr(env, f.name) for f in dataclasses.fields(env)})
        try:
            _ddp_setup(self, model, total_steps)
        finally:
            self.env = env
        print(f"[diag] dp on one rank wrapped in {type(self.model).__name__}", flush=True)

    _ddp.DDPStrategy.setup = _setup_with_ddp
