"""Diagnostic switches for benchmark runs only (benchmarks/gpu_cells.sh puts this folder on PYTHONPATH; every
process of a run, workers included, imports it at start-up). Nothing happens unless a variable below is set.

SHARDLAB_DIAG_NO_META=1  fsdp builds the ordinary (materialised) model instead of sharding on the meta device,
                         to compare the two builds' training speed.
SHARDLAB_DIAG_NO_CUDNN_SDP=1  torch.backends.cuda.enable_cudnn_sdp(False) in every process, and the SDPA priority
                         order printed once: DeepCompile (ZeRO-3) failed in inductor's code for the cuDNN attention
                         op (benchmarks/results/2026-11-26-h100-speed, calls 7-8).
SHARDLAB_DIAG_LAYERS=N   presets get N decoder layers (a big model's blocks on one GPU, at its own width).
SHARDLAB_DIAG_NO_NVTX=1  DeepSpeed records no NVTX ranges (deepspeed.utils.nvtx.enable_nvtx), to price them.
SHARDLAB_DIAG_DDP_KW='{"static_graph": true}'  extra keyword arguments (JSON) for dp's DistributedDataParallel: DDP's
                         own knobs (static_graph, broadcast_buffers, bucket_cap_mb) priced before any becomes an option.
SHARDLAB_DIAG_ONE_RANK_NO_SYNC=1  ZeRO-3's gather over a one-rank group (NoGatherCoalescedHandle) does not synchronise
                         the stream in wait(), as two ranks' gathers do not: whether that sync makes the one-GPU
                         emulation of the two-rank path (benchmarks/cells/h200-multirank-on-one.txt) slower. It did
                         not (2026-11-29-h200-zero3-compile-scope: 7% faster with the sync).
SHARDLAB_DIAG_RECOMPILE_LIMIT=N  torch._dynamo.config.recompile_limit (default 8): a frame compiled once per decoder
                         layer (a guard on each layer's own attributes) runs eagerly from its ninth version on.
SHARDLAB_DIAG_DEEPSPEED_LINEAR=1  zero3 --compile keeps DeepSpeed's memory-efficient linear, as before
                         2026-11-29-h200-zero3-compile-linear: under torch 2.11's compile a linear with a bias then gets
                         no weight gradient (the fault that page found; called SHARDLAB_DIAG_ALLOW_ZERO3_BLOOM_COMPILE
                         there, when it lifted a refusal of BLOOM).
SHARDLAB_DIAG_LOGITS_ALIVE=1  before each step, how many earlier micro-batches' logits are still alive, and what
                         Python objects refer to them: some zero3 --compile runs kept one or two 2 GiB logits-sized
                         tensors from step to step (2026-11-29-h200-zero3-compile-linear, call 4). On a GPU also the
                         allocator's live blocks of 0.5 GiB or more before steps 4 and 7, with the Python frames that
                         allocated each (torch.cuda.memory._record_memory_history from step 1 on).
SHARDLAB_DIAG_FSDP_RESHARD_ALL=1  fsdp reshards every unit after forward where it reshards, the last block and the root
                         too (strategies/fsdp.unit_reshards keeps those two gathered), to price the two gathers."""

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

if os.environ.get("SHARDLAB_DIAG_LAYERS"):
    import shardlab.training.models as _models

    _preset_config = _models._preset_config

    def _fewer_layers(preset):
        config = _preset_config(preset)
        config.num_hidden_layers = int(os.environ["SHARDLAB_DIAG_LAYERS"])
        return config

    _models._preset_config = _fewer_layers

if os.environ.get("SHARDLAB_DIAG_NO_NVTX"):
    import deepspeed.utils.nvtx as _nvtx

    _nvtx.enable_nvtx = False

if os.environ.get("SHARDLAB_DIAG_ONE_RANK_NO_SYNC"):
    from deepspeed.runtime.zero.partition_parameters import NoGatherCoalescedHandle, ZeroParamStatus

    def _wait_without_sync(self, **kwargs):
        if self._NoGatherCoalescedHandle__complete:
            return
        for param in self._NoGatherCoalescedHandle__params:
            param.ds_status = ZeroParamStatus.AVAILABLE
        self._NoGatherCoalescedHandle__complete = True

    NoGatherCoalescedHandle.wait = _wait_without_sync

if os.environ.get("SHARDLAB_DIAG_DDP_KW"):
    import json

    import shardlab.strategies.ddp as _ddp_kw

    _extra = json.loads(os.environ["SHARDLAB_DIAG_DDP_KW"])

    class _DDPWithKnobs(_ddp_kw.DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, **_extra})
            print(f"[diag] DistributedDataParallel with {_extra}", flush=True)

    _ddp_kw.DistributedDataParallel = _DDPWithKnobs

if os.environ.get("SHARDLAB_DIAG_RECOMPILE_LIMIT"):
    import torch._dynamo

    torch._dynamo.config.recompile_limit = int(os.environ["SHARDLAB_DIAG_RECOMPILE_LIMIT"])

if os.environ.get("SHARDLAB_DIAG_DEEPSPEED_LINEAR"):
    import shardlab.strategies.deepspeed_config as _ds_config  # build_ds_config's module: it looks the name up there

    _ds_config.plain_linear_under_compile = lambda stage, compile: {}

if os.environ.get("SHARDLAB_DIAG_LOGITS_ALIVE"):
    import gc
    import sys
    import weakref

    import shardlab.strategies.base as _base
    import shardlab.training.loss as _loss

    _logits: list[weakref.ref] = []
    _model_loss = _loss.model_loss

    def _model_loss_watched(outputs, labels, loss_fn, model):
        _logits.append(weakref.ref(outputs.logits))
        return _model_loss(outputs, labels, loss_fn, model)

    _train_step = _base.Strategy.train_step
    _steps = [0]

    def _big_blocks(min_bytes: int = 2**29) -> list[str]:
        """The allocator's live blocks of at least min_bytes, each with the innermost Python frames that made it."""
        import torch

        out = []
        for seg in torch.cuda.memory._snapshot()["segments"]:
            for block in seg["blocks"]:
                if block["state"] == "active_allocated" and block["size"] >= min_bytes:
                    frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in block.get("frames", [])
                              if f["filename"].endswith(".py")][:10]
                    out.append(f"{block['size'] / 2**30:.2f} GiB from {' < '.join(frames) or '?'}")
        return out

    def _train_step_watched(self, batches):
        import torch

        if self.env.device.type == "cuda":
            if _steps[0] == 0:  # every allocation's Python stack from here on (diagnostic runs only: it costs time)
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            elif _steps[0] in (3, 6):  # between steps: what stays allocated, and who made it
                print(f"[diag] before step {_steps[0] + 1}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated; "
                      "blocks of 0.5 GiB or more:\n  " + "\n  ".join(_big_blocks()), file=sys.stderr, flush=True)
        alive = [r() for r in _logits if r() is not None]
        _steps[0] += 1
        held = sorted({type(o).__name__ for t in alive for o in gc.get_referrers(t) if o is not alive})
        print(f"[diag] step {_steps[0]}: {len(alive)} of {len(_logits)} earlier logits alive"
              + (f", {tuple(alive[0].shape)} held by {held}" if alive else ""), file=sys.stderr, flush=True)
        del alive
        _logits[:] = [r for r in _logits if r() is not None]
        return _train_step(self, batches)

    _loss.model_loss = _model_loss_watched
    _base.Strategy.train_step = _train_step_watched

if os.environ.get("SHARDLAB_DIAG_FSDP_RESHARD_ALL"):
    import shardlab.strategies.fsdp as _fsdp

    _fsdp.unit_reshards = lambda reshard, block, blocks: reshard
