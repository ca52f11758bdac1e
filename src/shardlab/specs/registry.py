"""StrategySpec and the registry: every fact about a strategy name, owned in one place.

The rest of shardlab (config validation, the planner, reports, launch checks) reads these typed
fields instead of comparing name strings, so a new strategy is added without editing them.

Light on purpose: no torch, no deepspeed, no config import, so that ``config.py`` and the planner
can read the registry without the seconds those imports cost (and without an import cycle).
The implementation class is named as ``"module:Class"`` and imported only by ``spec.load()``.

Where the specs are declared: one small module per strategy implementation beside this one in
``specs/`` (``specs/ddp.py`` for ``strategies/ddp.py``, ...), found by listing this package. They
cannot sit at the top of the implementation files themselves: importing those imports torch (and
DeepSpeed's), which ``shardlab --help`` and config validation must not pay. Listing the package,
rather than naming its modules here, keeps "a new strategy = its implementation (+ its spec file,
+ its memory model under ``strategies/memory/``)" with no edit to this file; a new name served by an existing engine (as
``fsdp_offload`` is) is its spec file alone."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Literal

from ..errors import UserError

# Engine names differ from strategy names on purpose ("fsdp2", not "fsdp"): a comparison with one is never
# mistaken for the other (tests/test_registry.py greps for the strategy names outside strategies/ and specs/).
Engine = Literal["ddp", "deepspeed", "fsdp2", "torchao", "pipelining"]
State = Literal["params", "grads", "optimizer"]
Place = Literal["cpu", "nvme"]
# How a run's checkpoints are laid out (reshard.py and export.py read weights by it):
#   torch_dcp         torch.distributed.checkpoint under the HF model's names (dp, FSDP2, pipeline): reshardable
#                     to any world size, number of pipeline stages or other torch_dcp strategy
#   deepspeed_zero    DeepSpeed ZeRO 1-3 partitions: convertible to a universal checkpoint
#   deepspeed_stage0  DeepSpeed stage 0: whole fp32 states in one file, no partitions
#   deepspeed_nvme    DeepSpeed with states swapped to NVMe: not resharded nor exported
#   None              the strategy saves no checkpoints
CheckpointFormat = Literal["torch_dcp", "deepspeed_zero", "deepspeed_stage0", "deepspeed_nvme"]

# What a fresh config runs when no strategy is given.
DEFAULT_STRATEGY = "dp"
# The package a spec's `impl` is relative to: named, not imported (it sits above this one in the layers).
IMPL_PACKAGE = "shardlab.strategies"


@dataclass(frozen=True)
class StrategySpec:
    name: str
    engine: Engine
    help: str  # one line, for --help and listings
    impl: str  # "module:Class" of the implementation, relative to shardlab.strategies (IMPL_PACKAGE); imported lazily
    memory: str  # "module:Class" of its memory model (strategies/memory/: what it holds, which the planner asks), lazily
    order: int  # position in config.STRATEGIES, --help and the planner's tables
    zero_stage: int | None = None  # DeepSpeed's zero_optimization.stage
    sharded: frozenset[State] = frozenset()  # model states split across data-parallel ranks
    offload_params: Place | None = None  # where parameters live instead of the GPU
    offload_optimizer: Place | None = None  # where optimizer states (and their gradients) live instead of the GPU
    checkpoint_format: CheckpointFormat | None = None
    supports_compile: bool = True
    compile_per_block: bool = False  # --compile's 'auto' scope compiles each block apart (training/compiling.py)
    # the engine's hooks around each decoder block split even a whole-model torch.compile into one graph per block
    # (FSDP2's fully_shard per block, where its units are blocks: EngineMemory.graphs_per_block decides per run): what
    # a graph saves for backward is then per block (planning/memory.py)
    graph_breaks_per_block: bool = False
    uses_autocast: bool = True  # False where the engine casts weights itself (DeepSpeed, FSDP2)
    own_loss: bool = False  # the strategy computes the loss itself (pipeline's last stage): no loss_kernel
    eval_whole_steps: bool = False  # eval batches hold a whole step's micro-batches (pipeline schedules)
    supports_8bit: bool = False  # --optimizer adamw8bit (optim.check_optimizer_options)
    supports_in_backward: bool = False  # --optimizer-in-backward
    supports_bf16_master: bool = False  # --master-weights bf16 (optim.check_optimizer_options)
    supports_zenflow: bool = False  # DeepSpeed ZenFlow (needs a CPU optimizer with GPU-resident params)
    # --peft methods it trains (training/adapters.py); a method missing here is refused before any process starts
    adapters: frozenset[str] = frozenset()
    single_process: bool = False  # runs on one process only (the planner leaves it out of multi-GPU plans)
    # Rank in the planner's speed order (lower = faster); None: not ranked (its speed is not comparable).
    speed_rank: int | None = None
    speed_measured: bool = False  # the rank comes from a measurement, not from reasoning
    # Rank among strategies on several GPUs of a node, where the collectives and the sharded optimizer step reorder
    # them (planning/planner.py says what measured it); None: after those ranked, in the one-GPU order.
    multi_gpu_speed_rank: int | None = None
    multi_gpu_speed_measured: bool = False
    pin_measured: bool = False  # pinning the training thread was measured not to slow it (runtime/pin.py: pin_thread auto)
    oom_next: str = "zero3"  # what an out-of-memory run of this strategy suggests next

    @property
    def offloads(self) -> bool:
        return self.offload_params is not None or self.offload_optimizer is not None

    def eval_batch(self, micro: int, accum: int) -> int:
        """Rows of one eval batch: the micro batch, or a whole step's micro-batches where the strategy evaluates whole
        steps (the trainer's eval loader and the planner's eval moment both use this)."""
        return micro * (accum if self.eval_whole_steps else 1)

    def load(self) -> type:
        """The implementation class (imports its module: torch and the engine's libraries)."""
        module, cls = self.impl.split(":")
        return getattr(importlib.import_module(module, IMPL_PACKAGE), cls)


_REGISTRY: dict[str, StrategySpec] = {}
_discovered = False


def register(spec: StrategySpec) -> StrategySpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] != spec:
        raise ValueError(f"strategy {spec.name!r} is registered twice, differently")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _discover() -> None:
    """Import every module of this package once: each spec module registers the names it declares."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    from .. import specs  # here, not at the top: every spec module imports this one

    for info in pkgutil.iter_modules(specs.__path__):  # this module too: already imported, a no-op
        importlib.import_module(f"{specs.__name__}.{info.name}")


def all_specs() -> list[StrategySpec]:
    _discover()
    return sorted(_REGISTRY.values(), key=lambda s: (s.order, s.name))


def names() -> tuple[str, ...]:
    return tuple(s.name for s in all_specs())


def lookup(name: str | None) -> StrategySpec | None:
    """The spec of `name`, or None for a name no strategy has (e.g. read back from an old result file)."""
    _discover()
    return _REGISTRY.get(name) if name is not None else None


def spec(name: str) -> StrategySpec:
    found = lookup(name)
    if found is None:
        raise UserError(f"unknown strategy {name!r}", f"choose one of {', '.join(names())}")
    return found


def speed_order(gpus: int = 1) -> tuple[str, ...]:
    """Ranked strategies, fastest first (the planner recommends the first that fits), for a run on ``gpus`` GPUs in all:
    on several, those with a ``multi_gpu_speed_rank`` first, by it, then the rest in the one-GPU order."""
    ranked = [s for s in all_specs() if s.speed_rank is not None]
    if gpus > 1:
        return tuple(s.name for s in sorted(ranked, key=lambda s: (s.multi_gpu_speed_rank is None, s.multi_gpu_speed_rank or 0, s.speed_rank)))
    return tuple(s.name for s in sorted(ranked, key=lambda s: s.speed_rank))


def speed_measured(name: str, gpus: int = 1) -> bool:
    """Whether ``name``'s place in ``speed_order(gpus)`` comes from a measurement, not from reasoning."""
    s = spec(name)
    if gpus > 1:  # placed by its several-GPU rank if it has one, else by reasoning (its one-GPU place)
        return s.multi_gpu_speed_rank is not None and s.multi_gpu_speed_measured
    return s.speed_measured


def find(**facts) -> str:
    """The first name, in registry order, whose fields equal `facts` (e.g. engine="deepspeed", zero_stage=3,
    offload_params="cpu"): the canonical strategy with those facts; a later twin does not displace it."""
    for s in all_specs():
        if all(getattr(s, k) == v for k, v in facts.items()):
            return s.name
    raise LookupError(f"no strategy has {facts}")


__all__ = ["StrategySpec", "DEFAULT_STRATEGY", "register", "unregister", "all_specs", "names", "lookup", "spec",
           "speed_order", "find"]
