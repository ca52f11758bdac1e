"""What `ao_offload` (strategies/ao_offload.py: torchao's CPUOffloadOptimizer on one GPU) holds: fp32 weights on the
GPU, gradients only while accumulating (each one is copied out and freed as backward makes it otherwise), and pinned
host copies of every weight and gradient beside AdamW's m and v on the host."""

from __future__ import annotations

from fractions import Fraction

from ...specs.registry import StrategySpec
from . import EngineMemory, Held, Run, States, built_on_meta, pinned_bytes


class AOOffloadMemory(EngineMemory):

    def states(self, s: StrategySpec, d: int, precision: str, optimizer: str = "adamw", in_backward: bool = False,
               master_weights: str = "fp32") -> States:
        return States(Fraction(4), Fraction(0), Fraction(0),
                      "fp32 weights on the GPU; AdamW states, step and host copies on the CPU")

    def held(self, run: Run) -> Held:
        st, n = self.run_states(run), run.n
        # offload_gradients only with one micro-batch a step; accumulating keeps the fp32 gradients on the GPU until
        # step(). Measured bloom-3b m8 x 8: 53.61 GiB, 35.91 planned without these and the autocast copies
        # (benchmarks/results/*-h100-offload).
        grads = 4.0 * n if run.accum > 1 else 0.0
        return Held(float(st.params * n), grads, float(st.optimizer * n), st.where, float(st.per_param),
                    grads_in_backward=grads)

    def host(self, run: Run) -> dict[str, float]:
        # a pinned fp32 host copy of every weight and of every gradient, beside fp32 AdamW m and v (torchao's
        # optim/cpu_offload.py allocates them per parameter)
        pin = run.opts.pin_memory and run.device == "cuda"
        sizes = [k for k, _ in run.arch.param_sizes] or [run.n]
        return {"fp32 params copy (pinned per parameter)": sum(pinned_bytes(4 * k, pin) for k in sizes),
                "fp32 grads copy (pinned per parameter)": sum(pinned_bytes(4 * k, pin) for k in sizes),
                "AdamW m, v": 8.0 * run.n}

    def build(self, run: Run) -> tuple[str, float]:
        return built_on_meta(run) or super().build(run)
