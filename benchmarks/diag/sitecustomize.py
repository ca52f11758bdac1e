"""Diagnostic switches for benchmark runs only (benchmarks/gpu_cells.sh puts this folder on PYTHONPATH; every
process of a run, workers included, imports it at start-up). Nothing happens unless a variable below is set.

SHARDLAB_DIAG_NO_META=1  fsdp builds the ordinary (materialised) model instead of sharding on the meta device,
                         to compare the two builds' training speed."""

import os

if os.environ.get("SHARDLAB_DIAG_NO_META"):
    import shardlab.training.models as _models

    _models.meta_loadable = lambda cfg: False
