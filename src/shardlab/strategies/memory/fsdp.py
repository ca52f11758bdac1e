"""What `fsdp` and `fsdp_offload` (strategies/fsdp.py: FSDP2, MixedPrecisionPolicy) hold: fp32 sharded parameters,
gradients and AdamW states (on the host under CPUOffloadPolicy), 16-bit unsharded copies of the units being computed
and, while accumulating, the whole model's unsharded fp32 gradients. The engine's choices it follows
(reshard_after_forward, units, blocks_per_unit, accumulated_grad_bytes_per_param, random_init_by_module) are
strategies/fsdp.py's."""

from __future__ import annotations

import math
from fractions import Fraction

from ..fsdp import (accumulated_grad_bytes_per_param, blocks_per_unit, by_module_build_bytes,
                    params_gathered_through_backward, random_init_by_module, units)
from ...specs.registry import StrategySpec
from . import EngineMemory, Held, Run, States, cpu_adamw_temp_bytes, pinned_bytes, torch_adam_bytes

REDUCE = "end of backward (FSDP2's reduce-scatter: the largest unit's unsharded gradients and their fp32 reduce-scatter input)"


class FSDPMemory(EngineMemory):

    def states(self, s: StrategySpec, d: int, precision: str, optimizer: str = "adamw", in_backward: bool = False,
               master_weights: str = "fp32") -> States:
        if s.offload_params == "cpu":
            return States(Fraction(0), Fraction(0), Fraction(0), "fp32 params, grads, AdamW states sharded, kept on the CPU")
        grads = Fraction(0) if in_backward else Fraction(4)  # a step in backward frees each gradient once applied
        return States(Fraction(4, d), grads / d, torch_adam_bytes(optimizer) / d,
                      "fp32 params, grads, AdamW states sharded across GPUs")

    def held(self, run: Run) -> Held:
        st, n, d, lo, arch = self.run_states(run), run.n, run.world, run.lo, run.arch
        h = Held(float(st.params * n), float(st.grads * n), float(st.optimizer * n), st.where, float(st.per_param))
        if run.device == "cpu" and not run.spec.offloads and run.cfg.optimizer == "adamw":
            # torch's single-tensor AdamW on the CPU (fused on CUDA and for offloaded states): each shard's temporaries
            h.step["AdamW per-tensor temporaries (CPU)"] = cpu_adamw_temp_bytes(arch.largest_layer_params / d)
        # Accumulating: the whole model's unsharded gradients stay on the GPU between micro-batches, in fp32, even
        # under CPUOffloadPolicy (they replace the sharded ones, freed by zero_grad(set_to_none=True) at the step).
        if accumulated := accumulated_grad_bytes_per_param(run.accum) * n:
            h.backward["unsharded fp32 gradients accumulated between micro-batches (whole model)"] = accumulated
        upcast = 4 if run.mixed else 0
        per_unit = blocks_per_unit(run.cfg, d, arch.block_params, run.micro * run.cfg.seq_len, arch.layers, run.spec.name)
        unit = per_unit * arch.block_params  # a unit's blocks gather and reduce together
        # No reshard after forward: every unit's 16-bit copy from its forward to its backward (the whole model at the
        # start of backward), then a unit's unsharded gradients and their fp32 upcast. Resharding frees every unit after
        # its forward, the root's too: the root (embeddings, final norm, head) is gathered again when the gradient reaches
        # the head, as is one unit at a time in backward (params, 16-bit grads, their upcast, + the prefetched unit).
        if params_gathered_through_backward(run.cfg, d, run.spec.name):
            h.backward["unsharded params kept gathered from forward to backward (no reshard after forward)"] = float(lo * n)
            h.at_head["unsharded block grads and their fp32 upcast (backward)"] = float((lo + upcast) * unit)
        else:
            h.at_head["unsharded root params (gathered again for the head's backward)"] = float(lo * arch.root_params)
            h.at_head["unsharded block params/grads (backward, + prefetch)"] = float((2 * lo + upcast) * unit)
        h.at_head["the head's unsharded 16-bit weight gradient (root unit)"] = float(lo * arch.root_params)
        if units(run.cfg, d, run.spec.name) == "blocks":
            # The last unit reduced, the root (embeddings, tied head), reduces after the embedding's backward, when the
            # activations are gone: its unsharded 16-bit gradients, the fp32 reduce-scatter input they are copied into
            # (foreach_reduce), and every sharded gradient (the output becomes the root's shard). bloom-7b1 fsdp on two
            # H200s, micro 8, checkpointing: 59.2 GiB measured, 52.7 planned at the optimizer step without this moment.
            h.after_backward.append((h.grads + (lo + 4.0) * max(arch.root_params, unit), REDUCE))
        else:
            # one unit: its reduction runs once, at the end of backward, over the whole model: the fp32 (reduce_dtype)
            # input buffer beside the reduced output that becomes the sharded gradients
            h.step["fp32 reduce-scatter input of the whole model (one FSDP unit)"] = 4.0 * n
        return h

    def graphs_per_block(self, s: StrategySpec, cfg, world: int) -> bool:
        # one unit (the root alone) hooks only around the whole model, whose compiled graph then spans every block:
        # bloom-1b7 fsdp --compile on one H200 peaked at its eager figure (42.51 against 42.54 GiB), where units of
        # blocks on two ranks added 23 ALiBi biases (+5.75 GiB), as planned
        return s.graph_breaks_per_block and units(cfg, world, s.name) == "blocks"

    def optimizer_shapes(self, run: Run) -> set[int]:
        return {math.ceil(k / run.world) for k, _ in run.arch.param_sizes} or {run.arch.largest_param}

    def host(self, run: Run) -> dict[str, float]:
        if run.spec.offload_params != "cpu":
            return {}
        pin = run.opts.pin_memory and run.device == "cuda"
        shards = [math.ceil(k / run.world) for k, _ in run.arch.param_sizes] or [math.ceil(run.n / run.world)]
        out = {"fp32 param shards (pinned per parameter)": sum(pinned_bytes(4 * k, pin) for k in shards),
               # reduce-scattered gradients come to the CPU with .to('cpu', non_blocking=pin): pinned per parameter
               "fp32 gradient shards": sum(pinned_bytes(4 * k, pin) for k in shards),
               "AdamW m, v shards": 8.0 * sum(shards)}
        if run.device == "cuda":  # on a CPU run these are counted with the rank's allocations
            out["AdamW per-tensor temporaries (CPU)"] = cpu_adamw_temp_bytes(max(shards))
        return out

    def build(self, run: Run) -> tuple[str, float]:
        """On meta; a preset on several ranks drawn module by module where the shards live (random_init_by_module):
        on the GPU, or on the host (a CPU run, CPUOffloadPolicy) beside the fp32 shards."""
        arch, d = run.arch, run.world
        if arch.meta_build and random_init_by_module(d, arch.random_init):
            if run.device == "cuda" and run.spec.offload_params != "cpu":
                return "model built on meta, module by module on the GPU into the shards (load time)", 0.0
            return ("model built on meta, module by module on the host: the fp32 shards + the largest module and its slice "
                    "(load time)", 4.0 * math.ceil(run.n / d) + by_module_build_bytes(arch.largest_layer_params, d))
        if arch.meta_build:
            return "model built on meta, shards materialised (load time)", 0.0
        return super().build(run)

    def paper_bytes_per_param(self, s: StrategySpec, d: int) -> Fraction | None:
        return None if s.offloads else Fraction(16, d)  # P_os+g+p; the paper's figure has no offload
