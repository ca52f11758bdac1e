"""What each engine holds in memory, moment by moment of a training step, on the GPU and on the host.

One module per implementation file of strategies/ (``ddp.py`` for ``ddp.py``, ``deepspeed_zero.py`` for
``deepspeed_zero.py``, ...), beside the code whose decisions it counts; each spec names its model
(``StrategySpec.memory``), so a new name served by an existing engine adds nothing here. The planner
(planning/strategy_plan.py) asks a strategy's model what the engine holds and composes that with the architecture and the
activations of one micro-batch, which it counts itself; it names no engine. What a model answers:

    states    parameters, gradients and optimizer states per parameter on one GPU, and where they live
    held      those in bytes, and the buffers alive at each moment of one step (``Held``)
    per_gpu   for an engine whose GPUs hold different things (a pipeline's stages): each GPU's peak, planned by the
              engine over its own schedule, activations included (``PerGpu``); None for the others
    host      the buffers each rank keeps in host memory while it trains; ``build``: what it holds while the model
              is built; ``nvme``: what it keeps on NVMe

Bytes throughout; every measured figure names its measurement.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from ...errors import UserError
from ...specs.registry import StrategySpec

if TYPE_CHECKING:  # the planner's types: read here, never imported at run time (planning imports strategies)
    from ...config import RunConfig
    from ...planning.memory import Arch


class NotApplicable(UserError):
    """The engine cannot run this model or world at all (a full plan leaves the strategy out and says why)."""


# torch's single-tensor AdamW (the CPU path) holds two temporaries as large as the tensor it updates:
# a 50M-parameter model of 16 MiB tensors peaked 32 MiB above its resident size during step().
CPU_ADAMW_TEMP_TENSORS = 2

# torchao's AdamW8bit state layout (optim/adam.py _new_buffer, subclass_8bit.OptimState8bit): a tensor of at least
# EIGHT_BIT_MIN_NUMEL elements, a multiple of EIGHT_BIT_BLOCK, keeps each moment as 1 B codes plus an fp32 scale per
# block; smaller ones keep fp32 moments.
EIGHT_BIT_BLOCK, EIGHT_BIT_MIN_NUMEL = 256, 4096


def cpu_adamw_temp_bytes(largest: float) -> float:
    """Bytes of torch's single-tensor AdamW temporaries on a CPU (fp32) when the largest tensor it steps has
    ``largest`` elements: a parameter (dp, fsdp shards, a pipeline stage) or DeepSpeed's flat fp32 partition."""
    return CPU_ADAMW_TEMP_TENSORS * 4.0 * largest


def torch_adam_bytes(optimizer: str) -> Fraction:
    """Bytes per parameter of the AdamW moments torch-native engines keep: fp32 m and v, or torchao's 8-bit ones
    (1 B each plus an fp32 scale per block)."""
    return Fraction(2) + Fraction(2 * 4, EIGHT_BIT_BLOCK) if optimizer == "adamw8bit" else Fraction(8)


def pinned_bytes(nbytes: float, pinned: bool) -> float:
    """Host bytes of one buffer: torch's pinned (page-locked) allocator (CachingHostAllocator) rounds every
    request up to a power of two and keeps freed blocks cached, so a pinned 26 GiB buffer holds 32 GiB."""
    if not pinned or nbytes <= 0:
        return float(nbytes)
    return float(2 ** math.ceil(math.log2(nbytes)))


@dataclass(frozen=True)
class LayerBytes:
    """One micro-batch's activations around one decoder layer, as the planner counts them (planning/memory.py), for an
    engine that places layers itself (the pipeline's stages)."""
    saved: float  # saved by one layer for backward (its input only, under checkpointing)
    recompute: float  # one checkpointed layer recomputed in backward (0 without checkpointing)
    backward: float  # one layer's backward temporaries beyond what it saved
    input_grad_backward: float  # a split backward's input-gradient (I) temporaries of one layer
    weight_grad_inputs: float  # held by one layer from its input gradient (I) to its weight gradient (W)
    embed: float  # saved by the embedding
    final: float  # saved by the final norm and the head's input


@dataclass(frozen=True)
class Run:
    """The run a plan asks about, as an engine's memory model reads it (the planner makes one per strategy)."""
    spec: StrategySpec
    arch: Arch
    cfg: RunConfig
    micro: int
    accum: int
    precision: str  # bf16 | fp16 | fp32
    gpus_per_node: int
    nodes: int
    checkpointing: bool = False
    device: str = "cuda"  # cuda, or cpu: a CPU run's allocations
    autocast: bool = False  # forward under torch.autocast (training.optim.autocasts)
    layers: LayerBytes | None = None

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def n(self) -> int:
        return self.arch.n_params

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def lo(self) -> int:
        """Bytes of one element of an engine's working copy: 16 bits, or fp32 in fp32 runs."""
        return 2 if self.mixed else 4

    @property
    def bf16_master(self) -> bool:
        return self.cfg.master_weights == "bf16" and self.spec.supports_bf16_master

    @property
    def opts(self):
        return self.cfg.strategy_options


@dataclass(frozen=True)
class States:
    """Parameters, gradients and optimizer states per parameter on one GPU (exact), and where they live."""
    params: Fraction
    grads: Fraction
    optimizer: Fraction
    where: str

    @property
    def per_param(self) -> Fraction:
        return self.params + self.grads + self.optimizer


@dataclass
class Held:
    """What one rank holds on its GPU beyond one micro-batch's activations, in bytes, at each moment of a step."""
    params: float
    grads: float  # all gradients, as the optimizer step sees them (0 where a persistent buffer below holds them)
    optimizer: float
    where: str  # one line: where the states live
    states_per_param: float  # parameters + gradients + optimizer states per model parameter
    persistent: dict[str, float] = field(default_factory=dict)  # allocated once, alive throughout
    backward: dict[str, float] = field(default_factory=dict)  # alive at the start of backward, beside the activations
    at_head: dict[str, float] = field(default_factory=dict)  # besides those, once the loss' gradient reaches the head
    # made by backward's first gradient hook and kept to backward's end: the head's moment and every later one in
    # backward, not the start of backward
    from_first_grad: dict[str, float] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)  # alive at the optimizer step
    grads_in_backward: float = 0.0  # gradients alive from the start of backward (kept while accumulating)
    # more moments, once the activations are gone: (bytes beside the parameters, optimizer and persistent buffers, what)
    after_backward: list[tuple[float, str]] = field(default_factory=list)
    eval_gathered: float = 0.0  # parameters still gathered during an eval forward's loss
    notes: list[str] = field(default_factory=list)


@dataclass
class PerGpu:
    """A GPU plan: the peak, what makes it, the parts; an engine that plans each of its GPUs itself (``per_gpu``) gives
    the worst GPU's and every GPU's figures, the planner one rank's step (planning/step.py)."""
    peak: float
    moment: str
    parts: dict[str, float]  # as StrategyPlan.gpu (without the CUDA context, which the planner adds to every plan)
    states_per_param: float
    notes: list[str]  # the first says where the states live
    gpus: list[dict[str, Any]] = field(default_factory=list)  # each GPU's figures, where they differ (a pipeline's)
    moments: dict[str, float] = field(default_factory=dict)  # every moment weighed, by what it is (one rank's step)


class EngineMemory:
    """An engine's memory model; the defaults are a plain torch engine's."""

    cpu_process_bytes = 0  # what the engine's libraries add to a CPU rank's resident baseline

    def states(self, s: StrategySpec, d: int, precision: str, optimizer: str = "adamw", in_backward: bool = False,
               master_weights: str = "fp32") -> States:
        raise NotImplementedError

    def run_states(self, run: Run) -> States:
        cfg = run.cfg
        return self.states(run.spec, run.world, run.precision, cfg.optimizer, cfg.optimizer_in_backward,
                           "bf16" if run.bf16_master else "fp32")

    def held(self, run: Run) -> Held:
        raise NotImplementedError

    def per_gpu(self, run: Run) -> PerGpu | None:
        return None

    def host(self, run: Run) -> dict[str, float]:
        return {}

    def build(self, run: Run) -> tuple[str, float]:
        return "model built in fp32 on the CPU by every rank (load time)", float(4 * run.n)

    def nvme(self, run: Run) -> float:
        return 0.0

    def graphs_per_block(self, s: StrategySpec, cfg: RunConfig, world: int) -> bool:
        """Whether the engine's hooks split a whole-model ``torch.compile`` into one graph per block in a run of ``cfg``
        on ``world`` ranks (what a graph saves for backward is then per block: planning/memory.py)."""
        return s.graph_breaks_per_block

    def optimizer_shapes(self, run: Run) -> set[int]:
        """Elements of each tensor one rank's optimizer steps (the 8-bit step is compiled once per shape)."""
        return {k for k, _ in run.arch.param_sizes} or {run.arch.largest_param}

    def paper_bytes_per_param(self, s: StrategySpec, d: int) -> Fraction | None:
        """ZeRO paper (Rajbhandari et al. 2020, Fig. 1, K = 12 for mixed-precision Adam): bytes per parameter per GPU
        of the stage this engine matches; None where the figure has none."""
        return None

    def estimate(self, run: Run) -> dict[str, int] | None:
        """The engine's own estimator of its model states ({gpu, cpu} bytes), where it has one."""
        return None

    def batch(self, cfg: RunConfig, world: int) -> tuple[int, int] | None:
        """(micro, accumulation) the engine runs ``cfg`` at whatever the plan's micro batch; None: the plan's."""
        return None


def built_on_meta(run: Run, where: str = "materialised on the GPU") -> tuple[str, float] | None:
    """A GPU run of a preset or a matching local checkpoint builds on the meta device and draws the weights where the
    engine keeps them (Strategy.build_on_device): nothing on the host. None where the build is on the CPU."""
    if run.arch.meta_build and run.device == "cuda":
        return f"model built on meta, {where} (load time)", 0.0
    return None


@functools.cache
def _load(path: str) -> EngineMemory:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module, __package__.rpartition(".")[0]), cls)()


def memory_model(s: StrategySpec) -> EngineMemory:
    """The memory model ``s`` names (``StrategySpec.memory``, "module:Class" under strategies/)."""
    return _load(s.memory)


__all__ = ["NotApplicable", "LayerBytes", "Run", "States", "Held", "PerGpu", "EngineMemory", "memory_model",
           "built_on_meta", "pinned_bytes", "cpu_adamw_temp_bytes", "torch_adam_bytes", "EIGHT_BIT_BLOCK",
           "EIGHT_BIT_MIN_NUMEL"]
