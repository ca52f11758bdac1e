"""The data-parallel x pipeline layout of a run: which ranks share a batch, which hold which stage.

One owner for it. The launcher's preflight, the trainer (its sampler's dp size and rank), the pipeline
strategy (its process groups), the planner and the benchmark matrix all build it here, so a shape the
launcher accepts is the shape the workers run, planned and benchmarked with.

Ranks are numbered pipeline-major: ranks [d*P, (d+1)*P) form pipeline replica d, and rank d*P + p
holds pipeline position p (P = ranks per pipeline; 1 for every strategy but ``pipeline``). Under
interleaved 1F1B each position holds ``chunks`` virtual stages, loop-style: stage s on position s % P
(what torch's ScheduleInterleaved1F1B expects). Under zbv each position holds 2, in a V: position p
holds stages p and 2P-1-p (torch's ScheduleZBVZeroBubble), so the first and the last stage share position 0.
Placement is pipesim.schedules.place's, the simulator's own.

No torch import: the planner, the benchmark matrix and the CLI's checks run in processes that never
start torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UserError
from .pipesim.schedules import FIXED_CHUNKS, PLACEMENT, place
from .specs.registry import spec

if TYPE_CHECKING:
    from .config import RunConfig


def local_world_size() -> int:
    """How many ranks of this job run on this node: torchrun's / shardlab's LOCAL_WORLD_SIZE, else srun's
    SLURM_NTASKS_PER_NODE, else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)


class LayoutError(UserError):
    """A world size, model or micro-batch count that the configured pipeline cannot be formed from."""


def pipelined(cfg: "RunConfig", strategy: str | None = None) -> bool:
    """Whether the strategy splits the model into pipeline stages (even when --stages is 1).

    ``strategy``: ask for another strategy than ``cfg.strategy`` (the planner prices every strategy of one config)."""
    return spec(strategy or cfg.strategy).engine == "pipelining"


def pipeline_stages(cfg: "RunConfig", world: int, strategy: str | None = None) -> int:
    """Ranks one pipeline spans: --stages (default: all ranks) under the pipeline strategy, else 1."""
    if not pipelined(cfg, strategy):
        return 1
    return cfg.strategy_options.pp_stages or world


def data_parallel_size(cfg: "RunConfig", world: int, strategy: str | None = None) -> int:
    """Ranks that see different data (the batch triple's world size), without refusing a shape.

    For callers that only size a batch (dry run, slurm, autobatch, bench, plan); a run builds a
    ParallelLayout, which refuses a world that --stages does not divide."""
    return max(1, world // pipeline_stages(cfg, world, strategy))


def model_layers(hf_config) -> int | None:
    """Decoder blocks of an HF config (GPT-2's n_layer, everyone else's num_hidden_layers); None when it says neither."""
    return getattr(hf_config, "n_layer", None) or getattr(hf_config, "num_hidden_layers", None) or None


def model_family(hf_config) -> str:
    """gpt2 | bloom | llama (Llama-style: RMSNorm, gated SiLU MLP, RoPE) | generic, from an HF config: how the planner
    counts activations and how the pipeline strategy prices a block (strategies/pipeline.py)."""
    mt = getattr(hf_config, "model_type", "")
    if mt == "gpt2":
        return "gpt2"
    if mt == "bloom":
        return "bloom"
    if hasattr(hf_config, "intermediate_size") and hasattr(hf_config, "rms_norm_eps"):
        return "llama"  # llama, mistral, qwen2, ... (RMSNorm, gated SiLU MLP, RoPE)
    return "generic"


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    nodes: int = 1
    stages: int = 1  # ranks per pipeline (P); 1 without pipeline parallelism
    chunks: int = 1  # virtual stages per rank (V): interleaved 1F1B (--chunks) and zbv (2)
    microbatches: int | None = None  # micro-batches per optimizer step (M); None while the micro batch is 'auto'
    placement: str = "loop"  # which rank runs which virtual stage: "loop" (s % P) or "v" (zbv)

    def __post_init__(self) -> None:
        # Not user errors: from_config refuses these in the user's terms; a direct construction that breaks them is a bug.
        if self.world < 1 or self.stages < 1 or self.chunks < 1 or self.nodes < 1 or self.world % self.stages:
            raise ValueError(f"not a layout: world {self.world}, nodes {self.nodes}, stages {self.stages}, chunks {self.chunks}")
        if self.placement not in ("loop", "v") or (self.placement == "v" and self.chunks != 2):
            raise ValueError(f"not a layout: placement {self.placement!r} with {self.chunks} chunks")

    # ---- sizes --------------------------------------------------------------------------------------------
    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world // self.nodes)

    @property
    def replicas(self) -> int:
        """Pipeline replicas: copies of the whole model, each fed its own data."""
        return self.world // self.stages

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the replicas (every rank, without pipeline parallelism)."""
        return self.replicas

    @property
    def virtual_stages(self) -> int:
        """Pieces the model is cut into: stages x chunks."""
        return self.stages * self.chunks

    # ---- one rank's coordinates -----------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")

    def dp_rank(self, rank: int) -> int:
        """Which replica (which share of the data) ``rank`` belongs to."""
        self._check_rank(rank)
        return rank // self.stages

    def pp_rank(self, rank: int) -> int:
        """``rank``'s position in its pipeline (0: the embedding's, stages - 1: the LM head's without chunks)."""
        self._check_rank(rank)
        return rank % self.stages

    def node(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def stages_of(self, rank: int) -> list[int]:
        """The (virtual) stage ids ``rank`` runs, ascending: loop-style (s % stages == its pipeline position), or
        in a V (zbv: its position p and 2P-1-p)."""
        p = self.pp_rank(rank)
        return [s for s in range(self.virtual_stages) if self.stage_position(s) == p]

    def stage_position(self, stage: int) -> int:
        """The pipeline position (rank within a replica) that runs virtual stage ``stage``."""
        return place(stage, self.stages, self.placement)

    # ---- process groups -----------------------------------------------------------------------------------
    def pipeline_groups(self) -> list[list[int]]:
        """Ranks of every pipeline replica, replica d at index d, in pipeline order."""
        P = self.stages
        return [list(range(d * P, (d + 1) * P)) for d in range(self.replicas)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same pipeline position (average their gradients), position p at index p."""
        return [list(range(p, self.world, self.stages)) for p in range(self.stages)]

    def pipeline_group(self, rank: int) -> list[int]:
        return self.pipeline_groups()[self.dp_rank(rank)]

    def dp_group(self, rank: int) -> list[int]:
        return self.dp_groups()[self.pp_rank(rank)]

    # ---- from a run's configuration -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: "RunConfig", world: int, nodes: int | None = None, layers: int | None = None, *,
                    microbatches: int | None = None, check_schedule: bool = True, unit: str = "processes",
                    strategy: str | None = None) -> "ParallelLayout":
        """The layout of ``cfg`` on ``world`` ranks over ``nodes`` (default: cfg.nodes), refused in one line
        (LayoutError) where the pipeline cannot be formed.

        ``layers``: the model's decoder blocks, when known (more virtual stages than blocks is refused).
        ``microbatches``: M when the caller has it; else resolved from the batch triple (None under micro
        batch 'auto' without --grad-accum). ``check_schedule``: refuse an M that torch's schedule refuses
        (1F1B: fewer than one per stage; interleaved: not divisible by the stages); `shardlab plan` prices
        any M, as it always has. ``unit``: what the world counts, in the messages ('GPUs' in a plan). ``strategy``:
        another strategy than ``cfg.strategy`` (a plan prices every strategy of one config)."""
        nodes = cfg.nodes if nodes is None else nodes
        stages = pipeline_stages(cfg, world, strategy)
        opts = cfg.strategy_options
        if world % stages:
            fix = f"use --stages dividing {world}" + (f", or --gpus a multiple of {stages}" if unit == "processes" else "")
            raise LayoutError(f"{world} {unit} cannot form pipelines of {stages} stages (the world size must be a multiple of --stages)", fix)
        pipe = pipelined(cfg, strategy)
        chunks = opts.pp_chunks if pipe and opts.pp_schedule == "interleaved-1f1b" else 1
        placement = PLACEMENT.get(opts.pp_schedule, "loop") if pipe else "loop"
        if pipe and opts.pp_schedule in FIXED_CHUNKS:
            chunks = FIXED_CHUNKS[opts.pp_schedule]
            if layers and stages * chunks > layers:
                raise LayoutError(f"{opts.pp_schedule} places {chunks} stages on each rank: {stages * chunks} pipeline stages but {cfg.model} "
                                  f"has only {layers} layers", f"use at most {layers // chunks} rank(s) per pipeline (--stages), or --schedule 1f1b")
        if pipe and layers and stages * chunks > layers:
            raise LayoutError(f"{stages * chunks} pipeline stages but {cfg.model} has only {layers} layers", f"use at most {layers} stages (x chunks)")
        M = microbatches
        if M is None:
            M = cfg.resolve_batch(world // stages)[1] if cfg.micro_batch != "auto" else cfg.grad_accum
        if pipe and check_schedule and M is not None:
            if opts.pp_schedule == "1f1b" and M < stages:  # torch's Schedule1F1B refuses it on every rank
                raise LayoutError(f"1f1b needs at least one micro-batch per stage: {M} micro-batch(es) for {stages} stages",
                                  f"use --microbatches {2 * stages} (or at least {stages}), or --schedule gpipe")
            if opts.pp_schedule == "interleaved-1f1b" and M % stages:
                raise LayoutError(f"interleaved-1f1b needs the micro-batch count ({M}) divisible by the stages ({stages})",
                                  f"use --microbatches {stages * max(1, M // stages)}")
        return cls(world=world, nodes=nodes, stages=stages, chunks=chunks, microbatches=M, placement=placement)
