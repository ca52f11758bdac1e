"""`fsdp`, and `fsdp_offload` (its spec: specs/fsdp_offload.py): PyTorch FSDP2 (`fully_shard`), the
PyTorch-native peer of ZeRO-3. The offload fields of the run's spec choose CPUOffloadPolicy.

On several ranks each unit is one or a few consecutive transformer blocks (``blocks_per_unit``: so only a unit's
full weights live at a time), then the root; on one rank without offload the root alone (``units``). Parameters
become DTensors sharded on dim 0 across the mesh.
Mixed precision is FSDP's own policy: bf16/fp16 compute copies, fp32 sharded master
weights and fp32 gradient reduction.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .. import compat
from ..specs.registry import spec
from .torch_optim import TorchOptimizerStrategy

# Lazy imports below: transformers (training.models, compiling) and torch.distributed's fsdp/checkpoint modules load
# only when an FSDP engine is built or a checkpoint saved or loaded.


# ---- what the engine keeps on the GPU (read by its memory model, memory/fsdp.py) ------------------------------------


def accumulated_grad_bytes_per_param(accum: int) -> float:
    """GPU bytes per parameter *of the whole model* (not of a shard) that FSDP2 keeps between the micro-batches of
    a step. ``accumulate`` turns gradient sync off for all but the last micro-batch; FSDP2 then keeps every unit's
    *unsharded* gradient on the compute device (FSDPParam.unsharded_accumulated_grad), upcast after the unit's
    backward to MixedPrecisionPolicy's reduce_dtype, fp32 (to_accumulated_grad_if_needed); fp32 runs keep the fp32
    ``.grad`` itself. CPUOffloadPolicy does not change this: only reduce-scattered shards go to the host, on the
    synced micro-batch. So 4 B/param, not divided by the world size, from the first micro-batch's backward until the
    last one's reduce-scatter. Measured: bloom-3b fsdp_offload m8 x 8, 38.31 GiB, planned 28.84 without it
    (benchmarks/results/*-h100-offload)."""
    return 4.0 if accum > 1 else 0.0


def reshard_after_forward(cfg, world_size: int, strategy: str | None = None) -> bool:
    """Whether the units of a run on ``world_size`` ranks reshard after forward (``strategy``: the one planned, default
    ``cfg.strategy``); ``setup`` passes it to each ``fully_shard`` call through ``unit_reshards``, which keeps the last
    block and the root gathered. ``fsdp_reshard_after_forward`` given: as given. Unset: False on one rank without
    parameter offload, where the "shard" is the whole parameter, so resharding frees only the 16-bit gathered copy
    and backward gathers it again (gpt2-medium fsdp --compile micro 16 on one H200: 133k -> 154k tok/s median of 2,
    peak 20.18 -> 20.74 GiB: benchmarks/results/*-h100-speed/call3-h200). True otherwise: torch's default across
    ranks, and under CPUOffloadPolicy, which would keep the whole model's 16-bit copy on the GPU through backward."""
    given = cfg.strategy_options.fsdp_reshard_after_forward
    if given is not None:
        return given
    return world_size > 1 or spec(strategy or cfg.strategy).offload_params == "cpu"


def params_gathered_through_backward(cfg, world_size: int, strategy: str | None = None) -> bool:
    """Whether every unit keeps its unsharded 16-bit parameters from its forward until its backward, in a run on
    ``world_size`` ranks (``strategy`` as in ``reshard_after_forward``).

    ``setup`` passes the choice to every ``fully_shard`` call explicitly, the root's included (torch's own default
    would keep the root gathered: FSDPState._auto_reshard_after_forward): True frees every unit but the last block
    and the root after its forward (``unit_reshards``), False keeps the whole model's 16-bit copy (2 B/param in bf16)
    until backward. Measured: bloom-3b fsdp_offload m8 x 8, 38.31 -> 43.90 GiB with
    ``fsdp_reshard_after_forward=false``, exactly 2 B x 3.0B parameters, root included."""
    return not reshard_after_forward(cfg, world_size, strategy)


def unit_reshards(reshard: bool, block: int | None, blocks: int) -> bool:
    """Whether one ``fully_shard`` unit reshards after forward, in a run whose blocks do (``reshard``): block ``block``
    of ``blocks``, or the root (``block`` None). The last block and the root do not: backward gathers them again at
    once (the root for the head's gradient, the last block next), so resharding them frees nothing the peak at the
    head's backward does not hold again, and costs two gathers that nothing overlaps (torchtitan keeps its last
    block gathered alike). A root without blocks (one unit) follows ``reshard``."""
    if not reshard or not blocks:
        return reshard
    return block is not None and block < blocks - 1


def units(cfg, world_size: int, strategy: str | None = None) -> str:
    """What each ``fully_shard`` unit of a run on ``world_size`` ranks is (``strategy`` as in ``reshard_after_forward``):
    'blocks' (each transformer block, then the root) or 'model' (the root alone). ``fsdp_units`` given: as given.
    'auto': 'model' on one rank without parameter offload. There a unit's "gather" is a cast and a copy of the whole
    parameter (FSDP2's world-size-1 path) and resharding frees only the 16-bit copy, so per-block units bound no memory
    the run needs (the 16-bit copy of every block is alive from its forward to its backward once not resharding after
    forward) and cost 2 x 25 hook passes, per-unit gathers and reductions a step; one unit reduces once, at the end of
    backward (+4 B/param for its fp32 reduce buffer then, when the activations are gone). 'blocks' otherwise: across
    ranks a unit bounds the gathered memory, and under CPUOffloadPolicy a unit is what is copied to the GPU at a time.
    Measured on one H100: benchmarks/results/*-h100-fsdp."""
    given = cfg.strategy_options.fsdp_units
    if given != "auto":
        return given
    return "model" if world_size == 1 and spec(strategy or cfg.strategy).offload_params != "cpu" else "blocks"


# Parameters x tokens of a micro-batch that one unit should hold at least, so that its GPU work outlasts FSDP2's
# host work per unit (hooks, gathers and reductions: 1.0-1.6 ms each in forward, backward and reduction on an H200
# host). gpt2-large's two-rank path on one H200 (19.7M parameters a block, 8 x 1024 tokens: 1.6e11 a block) ran
# host-bound with units of 1 and 2 blocks (41.2k, 40.6k tok/s, medians of 3) and at the one-unit speed with 3 and 4
# (48.2k, 48.2k, medians of 2; 46-47k for one unit); llama-3.2-1b (60.8M a block, 5.0e11) kept 97% of its speed on two H200s with
# one block a unit (benchmarks/results/*-h200-fsdp-units). On two H200s gpt2-large's units of 3 ran as units of 1 did
# (one round 78k against 84k tok/s, one 68.5k against 68.7k: *-h200x2-units, call 1): unconfirmed there, not refuted;
# bloom-1b7 (50M a block: units of 2) kept 97.3% there.
UNIT_PARAM_TOKENS = 4.5e11
# The most blocks the automatic choice puts in a unit (the most measured): a unit's gathered parameters and gradients
# are held at once, so a small micro-batch (little work a block) must not gather half the model.
MAX_BLOCKS_PER_UNIT = 4


def blocks_per_unit(cfg, world_size: int, block_params: int, tokens: int, blocks: int, strategy: str | None = None) -> int:
    """Consecutive transformer blocks in one ``fully_shard`` unit where the units are blocks, in a run on ``world_size``
    ranks whose ``blocks`` blocks hold ``block_params`` parameters each and whose micro-batch holds ``tokens`` tokens
    (``strategy`` as in ``reshard_after_forward``). FSDP2 gathers, reduces and runs its hooks once per unit
    (``fully_shard`` of the blocks' list), so a unit of several blocks divides that host work.
    ``fsdp_blocks_per_unit`` given: as given. Unset: on several ranks without parameter offload, enough blocks for
    UNIT_PARAM_TOKENS, at most MAX_BLOCKS_PER_UNIT; else 1 (on one rank the units are blocks only under parameter
    offload, where a unit is what is copied to the GPU at a time: the less, the better)."""
    given = cfg.strategy_options.fsdp_blocks_per_unit
    if given:
        return min(given, max(1, blocks))
    if world_size <= 1 or blocks <= 1 or spec(strategy or cfg.strategy).offload_params == "cpu":
        return 1
    return max(1, min(blocks, MAX_BLOCKS_PER_UNIT, math.ceil(UNIT_PARAM_TOKENS / max(1, block_params * tokens))))


def unit_groups(blocks: list[nn.Module], per_unit: int) -> list[list[nn.Module]]:
    """The blocks, in order, cut into units of ``per_unit`` (the last may hold fewer)."""
    return [blocks[i:i + per_unit] for i in range(0, len(blocks), per_unit)]


def gather_after_step(cfg, world_size: int, strategy: str | None = None) -> bool:
    """Whether ``optimizer_step`` gathers (``FSDPModule.unshard``) every unit's parameters for the next forward right
    after the optimizer step. ``fsdp_gather_after_step`` given: as given. Unset: where the gathered parameters stay
    alive from forward to backward anyway (``params_gathered_through_backward``) and none is offloaded: it moves the
    gather's casts and copies (one per parameter on one rank, issued from Python) from the start of the next step,
    where the GPU sits idle after the step's loss sync until the host has issued them, to the end of this one, where the
    host runs ahead of the GPU; the next forward's pre-hooks find the parameters gathered. It holds the 16-bit copy
    between steps (and through an eval), which the forward would allocate anyway; state dicts reshard first
    (FSDP2's state-dict pre-hooks)."""
    given = cfg.strategy_options.fsdp_gather_after_step
    if given is not None:
        return given
    return params_gathered_through_backward(cfg, world_size, strategy) and spec(strategy or cfg.strategy).offload_params != "cpu"


def set_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """Explicit prefetch: each block's forward issues the all-gathers of the next ``depth`` blocks and its backward
    those of the ``depth`` blocks before it, so a gather is in flight before the host reaches the block that needs it
    (FSDP2's implicit prefetch issues it only then)."""
    if depth <= 0 or len(blocks) < 2:
        return
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1:i + 1 + depth]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        behind = blocks[max(0, i - depth):i][::-1]
        if behind:
            block.set_modules_to_backward_prefetch(behind)


# ---- what the build keeps (read by its memory model, memory/fsdp.py) ------------------------------------------------


def random_init_by_module(world_size: int, random_init: bool) -> bool:
    """Whether ``setup`` initialises the shards of a random-init model (a preset) module by module: on several ranks,
    where drawing per shard would give other numbers than the whole model's draws. Every rank walks transformers'
    initialisation over an unsharded meta skeleton, drawing each module's full tensors on the shards' device (the GPU,
    or the host under CPUOffloadPolicy and on CPU runs) in the ordinary build's order, and keeps its slice
    (init_by_module): the weights are the ordinary build's on that device (dp's), and beside the shards each rank holds
    the largest module's full tensors (``by_module_build_bytes``), not the model. On one rank the shards are the
    whole tensors, drawn in place (init_weights), and so are the shards where transformers' per-module init may not be
    intercepted (compat/module_init.py)."""
    return world_size > 1 and random_init and compat.enabled("init_by_module")


def by_module_build_bytes(largest_module_params: int, world_size: int) -> float:
    """Bytes one rank holds beside its shards, on the device it draws on, while ``random_init_by_module`` builds: the
    largest module's fp32 tensors (``init_by_module.peak_bytes``: a tensor lives from the first init that writes it to
    the last, within its own module's or its parent's, whose own tensors are smaller) and the rank's slice of them,
    which distribute_tensor clones before it is copied into the shard. gpt2-medium on 2 CPU ranks: setup grew rank 0
    by 0.98-1.01 GiB against 0.95 planned, its shards 0.66 + 1.5 x the 0.19 GiB embedding (tests/test_host_memory.py)."""
    return 4.0 * largest_module_params * (1 + 1 / world_size)


class FSDPStrategy(TorchOptimizerStrategy):
    def build_model(self) -> nn.Module:
        """On the meta device when ``setup`` can materialise it shard by shard (presets, local safetensors
        directories whose keys match): no rank ever holds the whole fp32 model. Else the ordinary build."""
        from ..training.models import build_model, meta_loadable

        if meta_loadable(self.cfg):  # (with --peft lora under bf16/fp16 a frozen base in that dtype: base_dtype)
            return build_model(self.cfg, dtype=self.base_dtype(torch.float32), meta=True)
        return super().build_model()

    def _materialise(self, model: nn.Module, device: torch.device) -> None:
        """Meta -> this rank's shards on ``device``, holding the ordinary build's weights (``random_init_by_module``
        on several ranks), then a local directory's files loaded one at a time into them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from ..training import adapters
        from ..training.models import init_weights, load_local_weights, resolve_preset

        model.to_empty(device=device)
        torch.manual_seed(self.cfg.seed)
        if random_init_by_module(self.env.world_size, resolve_preset(self.cfg.model) is not None):
            self._init_by_module(model, device)
        else:
            with adapters.base_only(model) as base:  # with --peft: the base's draws as without adapters (then theirs)
                init_weights(base)  # also fills buffers that are not in checkpoints (e.g. rotary inv_freq)
        opts = StateDictOptions(full_state_dict=True, strict=False)  # each file holds part of the model
        load_local_weights(model, self.cfg, lambda part: set_model_state_dict(model, part, options=opts))
        adapters.initialise(model, self.cfg.seed)  # with --peft: the adapters' own draws, each rank keeping its slice

    def _init_by_module(self, model: nn.Module, device: torch.device) -> None:
        """transformers' initialisation walked over an unsharded meta skeleton, one module's full tensors at a time on
        ``device`` (init_by_module); each rank copies its own slice of them into its shards. Every rank holds the
        same full tensors, so the slice is cut locally (``src_data_rank=None``): set_model_state_dict's
        distribute_tensor would scatter rank 0's copy to the others (gpt2-medium on 2 gloo ranks: setup
        13.7 s, 10.6 of them in set_model_state_dict; 9.9 s without it)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        from ..training import adapters
        from ..training.init_by_module import init_by_module
        from ..training.models import build_model

        def load(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for name, value in params.items():
                    param = base.get_parameter(name)
                    if isinstance(param, DTensor):
                        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                    param.copy_(value)
                for name, value in buffers.items():  # FSDP2 shards no buffers; non-persistent ones are in no state dict
                    base.get_buffer(name).copy_(value)

        with adapters.base_only(model) as base:  # the skeleton names the base model's tensors (a model with adapters too)
            init_by_module(build_model(self.cfg, meta=True), device, load)

    @classmethod
    def cpu_optimizer(cls, cfg) -> bool:
        return spec(cfg.strategy).offload_params == "cpu"

    def transfer_bytes_per_param(self) -> tuple[float, float]:
        # CPUOffloadPolicy copies the fp32 shard to the GPU at every unshard (forward, and backward again after a
        # reshard), for every micro-batch; the fp32 gradient shard comes back once, after the synced backward.
        gathers = 1 if params_gathered_through_backward(self.cfg, self.env.world_size) else 2
        return 4.0 * gathers * self.grad_accum, 4.0

    def setup(self, model: nn.Module, total_steps: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from ..training import compiling
        from ..training.models import block_params, transformer_blocks

        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        kwargs: dict = {"mesh": mesh}
        if self.precision.is_mixed:  # (--peft lora: a bf16 frozen base and fp32 adapters in one unit is fine, as FSDP2
            # wants one dtype among a unit's trainable parameters only, and gathers every parameter in param_dtype)
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.precision.dtype, reduce_dtype=torch.float32)
        if self.cpu_optimizer(self.cfg):
            # Pinning needs an accelerator; on a CPU-only run the "offload" is a no-op move anyway.
            pin = self.cfg.strategy_options.pin_memory and self.env.device.type == "cuda"
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
        on_meta = any(p.is_meta for p in model.parameters())
        if not self.cpu_optimizer(self.cfg) and not on_meta:
            model = model.to(self.env.device)
        compiled_blocks = compiling.compile_blocks(model, self.cfg)  # before sharding, as torchtitan
        blocks = transformer_blocks(model) if units(self.cfg, self.env.world_size) == "blocks" else []
        reshard = reshard_after_forward(self.cfg, self.env.world_size)
        self._per_unit = blocks_per_unit(self.cfg, self.env.world_size, block_params(blocks), self.micro_batch * self.cfg.seq_len,
                                         len(blocks))
        groups = unit_groups(blocks, self._per_unit)
        for i, group in enumerate(groups):
            fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=unit_reshards(reshard, i, len(groups)), **kwargs)
        fully_shard(model, reshard_after_forward=unit_reshards(reshard, None, len(groups)), **kwargs)
        firsts = [group[0] for group in groups]  # a unit's modules share one FSDP state; its first one stands for it
        set_prefetch(firsts, self.cfg.strategy_options.fsdp_prefetch or 0)
        if on_meta:  # sharded on meta: now allocate and fill only this rank's shards (CPU ones under offload)
            self._materialise(model, torch.device("cpu") if self.cpu_optimizer(self.cfg) else self.env.device)
        self.hf_model = model
        self._units = [model, *firsts]  # the root first, then the blocks' units, as forward reaches them
        self.model = compiling.compile_module(model, self.cfg) if self.cfg.compile and not compiled_blocks else model
        offload = self.cpu_optimizer(self.cfg)
        self._build_optimizer(model, "cpu" if offload else self.env.device.type, total_steps, cpu_fused=offload)

    def optimizer_step(self) -> float | None:
        norm = super().optimizer_step()
        if gather_after_step(self.cfg, self.env.world_size):
            for module in self._units:  # the root first, then the blocks, as forward reaches them
                module.unshard()  # issues the gather (one rank: casts and copies) on the GPU's queue, no host wait
        return norm

    def accumulate(self, last_micro: bool):
        # Reduce-scatter only once per optimizer step, like DDP's no_sync.
        self.hf_model.set_requires_gradient_sync(last_micro)
        return contextlib.nullcontext()

    def full_state_dict(self, trainable_only: bool = False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        sd = get_model_state_dict(self.hf_model, options=options)
        return sd if self.env.is_main else None

    def memory_note(self) -> str:
        where = "CPU" if self.cpu_optimizer(self.cfg) else "GPU"
        kept = "" if reshard_after_forward(self.cfg, self.env.world_size) else \
            "; not resharded after forward (gathered params kept until backward)"
        per = getattr(self, "_per_unit", 1)
        unit = "one unit (the whole model)" if units(self.cfg, self.env.world_size) == "model" else \
            "one unit per block + the root" if per == 1 else f"one unit per {per} blocks + the root"
        early = "; next step's params gathered right after the optimizer step" if gather_after_step(self.cfg, self.env.world_size) else ""
        return f"FSDP2: parameters, gradients and optimizer states sharded across ranks, kept on {where}; {unit}{kept}{early}"
