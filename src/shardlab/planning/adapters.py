"""What `--peft lora` and `--peft qlora` hold (training/adapters.py): a frozen base model, small trainable adapters.

    frozen base    lora: every weight in the compute dtype (fp32 in fp32 runs); qlora: the adapted model's linear
                   layers (all but the head) in 4-bit NF4 with double-quantised block scales, every other weight in
                   the compute dtype (build_quantised); sharded where the engine shards parameters, no gradients, no
                   optimizer states
    adapters       r x (in + out) per adapted linear layer, trained as the engine trains any parameter: its memory
                   model is asked about a model made of the adapters alone, so buckets, shards and offloads follow it
    activations    those of the full model (LoRA does not shrink them), less what a frozen layer keeps for its
                   weights' gradients, plus each adapter's own saved inputs

No engine is named here: the engine's own memory model answers for the adapters, and the base is placed by the
spec's facts (which states it shards, where it offloads parameters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..strategies.memory import EngineMemory, Held, Run
from .memory import Activations, Arch, frozen_layer_bytes

# bitsandbytes' NF4 with compress_statistics (the QLoRA recipe, training/adapters.four_bit_linear): 4 bits a weight,
# one absmax per 64 weights quantised to 8 bits, and one fp32 scale per 256 of those absmaxes.
NF4_BLOCK, NF4_SCALE_BLOCK = 64, 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALE_BLOCK)
# Where a 16-bit LoRA run keeps its frozen base: in the compute dtype (True) or fp32 under autocast (False, what
# shardlab did before the base was cast; tests plan the measured fp32-base run with it).
LORA_BASE_IN_COMPUTE_DTYPE = True


@dataclass(frozen=True)
class AdapterCounts:
    """The adapters of one model and one peft setting, counted from its linear layers."""
    method: str
    r: int
    params: int  # every adapter weight (A and B of each adapted layer)
    block_params: int  # the largest block's adapters (one FSDP unit's)
    sizes: tuple[tuple[int, int], ...]  # (numel, ndim) of each adapter weight
    in_widths_per_layer: float  # the adapted layers' input widths summed over one block (their saved inputs)
    adapted_per_layer: float  # adapted linear layers per block
    quantised: int  # qlora: the weights stored in 4 bits (every linear but the head), else 0
    quantised_block: int  # the largest block's quantised weights
    largest_quantised: int  # the largest 4-bit weight (dequantised whole in its backward)


def _targeted(name: str, targets: str | list[str], linear_names: set[str]) -> bool:
    """peft's matching rule (check_target_module_exists): 'all-linear' is every linear but the head; a string is a
    regular expression matched against the full name; a list matches names equal to or ending in '.' + an entry."""
    if targets == "all-linear":
        return name in linear_names
    if isinstance(targets, str):
        import re
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def count_adapters(arch: Arch, method: str, r: int, targets: str | list[str]) -> AdapterCounts:
    """``AdapterCounts`` from ``arch.linears`` (every linear layer but the head: name, in, out, block index)."""
    names = {n for n, *_ in arch.linears}
    chosen = [(n, i, o, b) for n, i, o, b in arch.linears if _targeted(n, targets, names)]
    blocks = max(1, arch.layers)
    per_block: dict[int, int] = {}
    for _, i, o, b in chosen:
        per_block[b] = per_block.get(b, 0) + r * (i + o)
    quant = [(i * o, b) for _, i, o, b in arch.linears] if method == "qlora" else []
    q_block: dict[int, int] = {}
    for k, b in quant:
        q_block[b] = q_block.get(b, 0) + k
    return AdapterCounts(
        method=method, r=r, params=sum(r * (i + o) for _, i, o, _ in chosen),
        block_params=max(per_block.values(), default=0),
        sizes=tuple(s for _, i, o, _ in chosen for s in ((r * i, 2), (r * o, 2))),
        in_widths_per_layer=sum(i for _, i, _, _ in chosen) / blocks, adapted_per_layer=len(chosen) / blocks,
        quantised=sum(k for k, _ in quant), quantised_block=max(q_block.values(), default=0),
        largest_quantised=max((k for k, _ in quant), default=0))


def base_bytes(run: Run, ad: AdapterCounts) -> float:
    """The frozen base's bytes, whole (before any sharding)."""
    n = run.arch.n_params
    if ad.method == "qlora":  # the rest in the compute dtype, as build_quantised keeps it
        return NF4_BYTES_PER_PARAM * ad.quantised + run.lo * (n - ad.quantised)
    return float((run.lo if LORA_BASE_IN_COMPUTE_DTYPE else 4) * n)


def compute_mode(mode: str, ad: AdapterCounts) -> str:
    """A 16-bit base (LoRA's in the compute dtype; QLoRA's 4-bit layers and the rest in the compute dtype) computes as
    a 16-bit model (its residual stream and norms in bf16): the 'lp' activations, whether or not autocast is on for
    the fp32 adapters."""
    if mode == "autocast" and (ad.method == "qlora" or LORA_BASE_IN_COMPUTE_DTYPE):
        return "lp"
    return mode


def autocast_params(arch: Arch, ad: AdapterCounts, mode: str) -> int | None:
    """The fp32 weights autocast casts and saves for backward (step.autocast_copies): an fp32 base's all, a qlora
    base's unquantised matmul weights (the head: bitsandbytes dequantises its own layers), and the adapters."""
    if mode != "autocast":
        return None
    if ad.method == "qlora":
        return (arch.pipeline_parts or {}).get("head", 0) + ad.params
    return arch.n_params + ad.params


def trainable_arch(arch: Arch, ad: AdapterCounts) -> Arch:
    """``arch`` as an engine's memory model should see the trainable part: a model made of the adapters alone."""
    return dataclasses.replace(
        arch, n_params=ad.params, largest_layer_params=max((k for k, _ in ad.sizes), default=0),
        block_params=ad.block_params, root_params=0, persistent_params=ad.params, param_sizes=ad.sizes,
        pipeline_parts=None)


def held(run: Run, model: EngineMemory, ad: AdapterCounts) -> Held:
    """What one rank holds: the engine's answer for the adapters, and the frozen base beside it, sharded where the
    engine shards parameters and on the host where it offloads them; a sharded base is gathered a unit at a time."""
    h = model.held(dataclasses.replace(run, arch=trainable_arch(run.arch, ad)))
    base, s = base_bytes(run, ad), run.spec
    shards = run.world if "params" in s.sharded else 1
    if s.offload_params is None:
        h.params += base / shards
    if shards > 1 or s.offload_params is not None:
        per_param = base / max(1, run.arch.n_params)
        # the unit being computed and the one prefetched, gathered in the base's own bytes
        h.at_head["frozen base: the block gathered for backward and the next one"] = 2 * per_param * run.arch.block_params
    if ad.method == "qlora":
        # bitsandbytes' backward dequantises each 4-bit weight whole to compute the input gradient
        h.at_head["a 4-bit weight dequantised in its backward"] = float(run.lo * ad.largest_quantised)
    h.states_per_param = (h.params + h.grads + h.optimizer) / max(1, run.arch.n_params)
    h.where = f"{ad.method}: frozen base ({base / 2**30:.2f} GiB whole) + {ad.params:,} adapter weights: {h.where}"
    return h


def activations(act: Activations, arch: Arch, ad: AdapterCounts, mode: str, micro: int, seq: int, dropout: float,
                checkpointing: bool, autocast: bool = False) -> Activations:
    """``act`` (the full model's, as full fine-tuning saves them) corrected for a frozen base with adapters.

    ``mode`` 'autocast' (an fp32 base): each adapter keeps A·x (r wide) for B and, for A, its input where it is a new
    tensor: the dropout's output and mask, or autocast's 16-bit cast of the fp32 input. A 16-bit base ('lp'): the base's
    linear layers and norms keep nothing for weights that get no gradient (``frozen_layer_bytes``), and each adapter
    keeps its input: peft's plain LoRA layer casts a 16-bit input to its fp32 adapters, which ``autocast`` casts back,
    a new 16-bit copy per adapted layer (checked on CPU: tests/test_plan_adapters.py); bitsandbytes' 4-bit LoRA layer
    does not cast under autocast, and its adapters keep the very inputs the base layers would have (all-linear)."""
    lo = 4 if mode == "fp32" else 2
    own = 0.0  # each adapter's own saved input, where it is a new tensor (bytes per token and layer)
    if dropout > 0:  # the dropout's output and its mask
        own = (lo + 1) * ad.in_widths_per_layer
    elif mode == "autocast" or (autocast and ad.method == "lora"):  # autocast's 16-bit cast of an fp32 input
        own = 2.0 * ad.in_widths_per_layer
    freed = 0.0  # what a 16-bit frozen base does not keep; the adapters' own copies replace the shared inputs
    if mode != "autocast":
        linear_inputs, norm_inputs = frozen_layer_bytes(arch, mode)
        freed = (norm_inputs + (linear_inputs if own else 0.0)) * arch.hidden
    one = (own - freed + lo * ad.r * ad.adapted_per_layer) * micro * seq
    if checkpointing:
        return dataclasses.replace(act, recompute=act.recompute + one)
    return dataclasses.replace(act, layers=act.layers + one * arch.layers, per_layer=act.per_layer + one)


__all__ = ["AdapterCounts", "count_adapters", "held", "activations", "base_bytes", "compute_mode", "autocast_params",
           "trainable_arch", "NF4_BYTES_PER_PARAM", "LORA_BASE_IN_COMPUTE_DTYPE"]
