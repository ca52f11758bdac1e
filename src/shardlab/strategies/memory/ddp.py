"""What `dp` (strategies/ddp.py: torch DDP, everything replicated) holds: fp32 weights, gradients and AdamW states on
every GPU (bf16 weights and gradients with ``--master-weights bf16``); across ranks DDP's gradient buckets, of which
the gradients are views (gradient_as_bucket_view=True)."""

from __future__ import annotations

from fractions import Fraction

from ...specs.registry import StrategySpec
from . import EngineMemory, Held, Run, States, built_on_meta, cpu_adamw_temp_bytes, torch_adam_bytes

TIED = "end of backward (all gradients + the tied embedding's second gradient)"


class DDPMemory(EngineMemory):

    def states(self, s: StrategySpec, d: int, precision: str, optimizer: str = "adamw", in_backward: bool = False,
               master_weights: str = "fp32") -> States:
        # a step in backward frees each gradient as soon as it is applied (none left for a whole model)
        weight = Fraction(2) if master_weights == "bf16" else Fraction(4)
        grads = Fraction(0) if in_backward else weight
        if master_weights == "bf16":
            return States(weight, grads, torch_adam_bytes(optimizer),
                          "bf16 weights and grads (no fp32 copy), 8-bit AdamW m and v on every GPU")
        return States(Fraction(4), grads, torch_adam_bytes(optimizer),
                      "fp32 weights, fp32 grads, fp32 AdamW m and v on every GPU")

    def held(self, run: Run) -> Held:
        st, n = self.run_states(run), run.n
        grads = float(st.grads * n)
        h = Held(float(st.params * n), grads, float(st.optimizer * n), st.where, float(st.per_param),
                 grads_in_backward=grads if run.accum > 1 else 0.0)  # zero_grad(set_to_none) frees them between steps
        if run.device == "cpu" and run.cfg.optimizer == "adamw":
            # optim.adamw: fused on CUDA (no temporaries). On the CPU torch takes the single-tensor path (foreach
            # kernels are for accelerators): each parameter's sqrt(v) and its quotient, freed before the next one.
            h.step["AdamW per-tensor temporaries (CPU)"] = cpu_adamw_temp_bytes(run.arch.largest_layer_params)
        if run.world > 1:
            # DDP's buckets (allocated with the wrapper, in the gradients' dtype) hold the gradients as views
            # (gradient_as_bucket_view=True): none beside them at the step. Backward makes each gradient afresh after
            # zero_grad(set_to_none=True) and DDP swaps it for its bucket view at once; while accumulating (no_sync)
            # the micro-batches' gradients are separate tensors until the last one's backward copies them in.
            h.persistent["DDP gradient buckets (the gradients are views of them)"] = grads
            h.grads = 0.0
        parts = run.arch.pipeline_parts or {}
        if parts.get("tied") and grads:
            # A tied head (GPT-2, BLOOM): the embedding's backward, the last of backward, makes a whole vocab x hidden
            # gradient that autograd then adds into the head's, beside every other gradient of the model. gpt2 fp32,
            # micro 1 x 256, one H100 (peak snapshots, benchmarks/results/*-h100-zero3-one-rank/call5): 2.06 GiB
            # measured, 1.88 planned without it. On several ranks the others are bucket views by then: beside the
            # buckets only the head's contribution (and, accumulating, the tied weight's accumulated gradient).
            tied = grads / n * parts["vocab_x_hidden"]
            alive = grads if run.world == 1 else tied * (2 if run.accum > 1 else 1)
            h.after_backward.append((alive + tied, TIED))
        return h

    def build(self, run: Run) -> tuple[str, float]:
        # on the meta device and drawn on the GPU; else on the CPU in fp32 (the master weights) or bf16 (--master-weights bf16)
        if (meta := built_on_meta(run)) is not None:
            return meta
        if run.bf16_master:
            return "model built in bf16 on the CPU (load time)", float(2 * run.n)
        return super().build(run)

    def paper_bytes_per_param(self, s: StrategySpec, d: int) -> Fraction | None:
        return Fraction(16)  # the paper's baseline: nothing sharded
