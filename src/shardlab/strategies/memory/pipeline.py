"""What `pipeline` (strategies/pipeline.py: torch.distributed.pipelining) holds on each GPU of a pipeline, over the
schedule's own order of micro-batches. Its GPUs differ, so it plans each of them itself (``per_gpu``), with the
activations the planner counts per layer (``Run.layers``).

Per GPU of one pipeline (P GPUs, V model chunks each under interleaved 1F1B, M micro-batches per step):

* **Model states of its stages only.** The split is the strategy's own (``split_blocks``: ``stage_costs`` over the
  strategy's per-layer and LM-head FLOP costs), so plan and training cut the model in the same place.
  The first stage holds the embedding, the last the final norm and LM head; a tied embedding is a
  second copy on the last GPU. The pipeline uses torch's AdamW over fp32 weights:
  4 (weights) + 4 (gradients) + 8 (m, v) bytes per parameter.
* **Autocast inside each stage** (``Stage.forward``) under bf16, over fp32 weights: the layers save what
  they save under dp's autocast (the planner's 'autocast' mode: training.optim.autocasts), the residual stream between stages stays fp32,
  and the last stage's logits are bf16 (2·b·s·V) until the loss upcasts them. Each forward also leaves
  a 16-bit copy of the stage's matmul weights for its backward: one per micro-batch in flight, where dp
  holds one. fp32 runs are all fp32.
* **Activations of the micro-batches in flight.** The schedule's per-GPU action order (the one
  ``shardlab pipeline simulate`` checks against torch: pipesim.device_orders) is walked: a forward adds
  that stage's saved tensors for one micro-batch, a backward releases them. GPipe holds all M on every
  stage; 1F1B holds min(M, P - s) on stage s (P on the first).
* **zbv** (2 stages per GPU in a V, GPU d holding stages d and 2P-1-d: layout.stages_of) splits each backward
  into I and W. A micro-batch's activations stay until its W (torch's input-gradient backward keeps the graph
  for it), and from its I to its W the stage also holds the gradient at every weight's output, the W's input
  (``LayerBytes.weight_grad_inputs`` per layer; the logits' gradient on the last stage). Gradients exist from the
  first W on. The first stage's I is empty and its W is its whole backward. The turn of the V (stage P-1 to P,
  one GPU) passes tensors by reference: stage P's receive buffers hold stage P-1's outputs, counted once. The I
  leaves each input's gradient on its receive buffer (.grad) until the next step begins.
* interleaved 1F1B and zbv run on torch's _PipelineScheduleRuntime, which waits for its sends when the step ends:
  outputs sent to another GPU and input gradients sent back stay referenced until then.
* **torch.distributed.pipelining's buffers** (torch/distributed/pipelining/stage.py, PipelineStage):
  every non-first stage pre-allocates M receive buffers for its input and every non-last stage M
  receive buffers for its output gradient (each b·s·h fp32, kept for the whole run); the stage output
  is kept in ``fwd_cache`` until its backward, the last stage's logits (p·b·s·V) too. On a torch whose
  ``schedule.step`` takes ``return_outputs`` (checked at run time; 2.13's does) shardlab passes False and that is all; on older ones
  the last stage also keeps every micro-batch's logits in ``output_chunks`` until the next step and
  concatenates them at the end of the step (another M·p·b·s·V, p the logits' bytes).
* **The loss** (transformers' ForCausalLMLoss) on the last stage: the fp32 log-softmax output (4·b·s·V) is
  saved per micro-batch in flight, and its backward holds two more b·s·V fp32 tensors. Every other backward holds
  one layer's temporaries (``LayerBytes.backward``) and, with checkpointing, one recomputed layer.
* The peak of a GPU is the largest of: every forward's end, every backward's start (grads live after
  the first backward of the step), the merge of the logits at the end of the step, and the optimizer
  step (gradients flattened for the all-reduce across pipeline replicas when there are several).
The worst GPU is the plan's per-GPU peak; ``PerGpu.gpus`` (the plan's ``stages``) lists every GPU.
"""


from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

from ...layout import LayoutError, ParallelLayout, data_parallel_size
from ...pipesim.schedules import device_orders
from ...specs.registry import StrategySpec
from . import EngineMemory, NotApplicable, PerGpu, Run, States, cpu_adamw_temp_bytes

BYTES_PER_PARAM = {"parameters": 4, "gradients": 4, "optimizer": 8}  # fp32 weights, grads, AdamW m and v
R = 4  # fp32 residual stream: stage inputs, outputs and their gradients (fp32 under autocast too)


def pipeline_split(arch, seq_len: int, n_stages: int) -> list[tuple[int, int]]:
    """The [start, end) blocks of every (virtual) stage: strategies/pipeline.py's own split_blocks."""
    from ..pipeline import split_blocks  # lazy: the strategy imports torch.distributed; a plan needs only its split

    shim = SimpleNamespace(  # what split_blocks reads of an HF config (rms_norm_eps: how layout.model_family tells Llama-style)
        hidden_size=arch.hidden, vocab_size=arch.vocab, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        intermediate_size=arch.ffn, **({"rms_norm_eps": 1e-5} if arch.family == "llama" else {}))
    return split_blocks(shim, arch.layers, seq_len, n_stages)


def pipeline_layout(cfg, gpus_per_node: int, nodes: int, layers: int, microbatches: int, strategy: str) -> ParallelLayout:
    """The layout `train --strategy pipeline` would run ``cfg`` in, its shape errors as NotApplicable (a full plan leaves
    the pipeline out). Any M is priced: what torch's schedules refuse, `train` refuses."""
    try:
        return ParallelLayout.from_config(cfg, gpus_per_node * nodes, nodes, layers, microbatches=microbatches, check_schedule=False,
                                          unit="GPUs", strategy=strategy)  # a full plan prices the pipeline row of any config
    except LayoutError as err:
        raise NotApplicable(err.message, err.hint) from None


@dataclass
class _Stages:
    """Per (virtual) stage, one micro-batch's: what its forward saves until its backward, what its backward holds beyond
    that, its receive buffers (all micro-batches'), and what a split backward holds from its I to its W."""
    saved: list[float]
    transient: list[float]
    buffers: list[float]
    pending: list[float]
    local_next: set[int]  # zbv's turn of the V: stage k's output is stage k+1's input on the same GPU, by reference
    keeps: bool  # the last stage's logits kept in output_chunks until the step ends
    pl: int  # bytes of a logit: the last stage's output in the compute dtype
    sbh: float
    bsv: float


def _stages(run: Run, layout: ParallelLayout, bounds: list[tuple[int, int]]) -> _Stages:
    from ..pipeline import step_keeps_outputs  # lazy, as split_blocks above

    parts, layer = run.arch.pipeline_parts, run.layers
    M, last = layout.microbatches, len(bounds) - 1
    pl = 2 if run.autocast else 4
    sbh, bsv = float(run.cfg.seq_len * run.micro * run.arch.hidden), float(run.micro * run.cfg.seq_len * run.arch.vocab)
    keeps = step_keeps_outputs()
    local_next = {k for k in range(last) if layout.stage_position(k) == layout.stage_position(k + 1)}
    st = _Stages([], [], [], [], local_next, keeps, pl, sbh, bsv)
    for k, (lo, hi) in enumerate(bounds):
        x = (hi - lo) * layer.saved
        x += layer.embed if k == 0 else -R * sbh  # a later stage's saved input is its receive buffer
        # last: log-softmax out, and (when not kept in output_chunks) the logits in fwd_cache; else: the output in fwd_cache
        x += (layer.final + (4 + (0 if keeps else pl)) * bsv) if k == last else (0 if k in local_next else R * sbh)
        if run.autocast:  # each forward casts the stage's matmul weights anew (the cache ends with the autocast
            # region) and autograd keeps those 16-bit copies until that micro-batch's backward; embeddings are not cast,
            # and checkpointed blocks keep only their input (the copies are made again in the recompute)
            x += 2.0 * ((0 if run.checkpointing else sum(parts["blocks"][lo:hi])) + (parts["head"] if k == last else 0))
        st.saved.append(x)
        # backward: the loss' gradients at the head first, then each layer's (recomputed, with checkpointing) temporaries
        layer_bwd = layer.recompute + layer.backward
        st.transient.append(max(8 * bsv, layer_bwd) if k == last else layer_bwd)
        st.buffers.append(M * R * sbh * ((k > 0) + (k < last)))
        # split backward, from I to W: every weight's output gradient (the last stage's logits' too, and its final norm's)
        st.pending.append((hi - lo) * layer.weight_grad_inputs + ((pl * bsv + R * sbh) if k == last else 0.0))
    return st


def _stage_params(parts: dict, bounds: list[tuple[int, int]], k: int, on_device: list[int]) -> int:
    lo, hi = bounds[k]
    n = sum(parts["blocks"][lo:hi])
    if k == 0:
        n += parts["embed"]
    if k == len(bounds) - 1:
        n += parts["final_norm"] + parts["head"]
        if parts["tied"] and 0 in on_device:
            n -= parts["vocab_x_hidden"]  # the tied weight is one Parameter on one device
    return n


class _Walk:
    """One GPU's walk over its schedule's actions: what it holds after each, and the candidate peaks (saved
    activations, logits + loss tensors, gradients, step temporaries, what)."""

    def __init__(self, st: _Stages, grads: float, runtime: bool, i_transient: float, largest_weight):
        self.st, self.grads, self.runtime, self.i_transient, self.largest_weight = st, grads, runtime, i_transient, largest_weight
        self.held = self.retained = self.input_grads = 0.0
        self.grads_live = False
        self.in_flight = self.peak_in_flight = 0
        self.moments: list[tuple[float, float, float, float, str]] = []

    def forward(self, a, last: int) -> None:
        st = self.st
        self.held += st.saved[a.stage]
        self.retained += st.pl * st.bsv if (a.stage == last and st.keeps) else 0.0
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.moments.append((self.held, self.retained, self._g(), 0.0, f"end of forward {a.microbatch} (stage {a.stage})"))

    def backward(self, a, last: int) -> None:
        """A full backward, an input gradient, or the first stage's W (its whole backward: its I is empty)."""
        st, k = self.st, a.stage
        loss_tmp = 8 * st.bsv if (k == last and 8 * st.bsv >= st.transient[k]) else 0.0
        what = {"B": "backward", "I": "input gradient (I)", "W": "weight gradient (W, the stage's whole backward)"}[a.kind]
        self.moments.append((self.held + st.transient[k] - loss_tmp, self.retained + loss_tmp, self._g(), 0.0,
                             f"start of {what} {a.microbatch} (stage {k}, {self.in_flight} micro-batches in flight)"))
        if a.kind == "I":  # the activations stay for the W; the gradients at the weights' outputs join them
            # its peak: the stage's weights' output gradients all captured, its first layer's backward running with
            # nothing freed (retain_graph)
            self.moments.append((self.held + st.pending[k] + self.i_transient, self.retained, self._g(), 0.0,
                                 f"input gradient (I) {a.microbatch} (stage {k}: the W's inputs held, nothing freed)"))
            self.held += st.pending[k]
            if k - 1 not in st.local_next:  # torch's input backward leaves the input's gradient on the receive buffer
                self.held += R * st.sbh  # (.grad) until the next step begins (the turn of the V's is stage P-1's buffer)
                self.input_grads += R * st.sbh
            return
        self.held -= st.saved[k]
        self.held += R * st.sbh * self.runtime * ((k < last and k not in st.local_next)  # its sent output
                                                  + (a.kind == "B" and k > 0))  # and its sent input gradient
        self.in_flight -= 1
        self.grads_live = True

    def weight_grad(self, a, last: int) -> None:
        """The weight gradient of a later stage: each weight's gradient made, then added to .grad."""
        st, k = self.st, a.stage
        w_tmp = 4.0 * self.largest_weight(k) if self.grads_live else 0.0  # the first W assigns .grad, later ones add
        self.moments.append((self.held + w_tmp, self.retained, self._g(), 0.0, f"weight gradient (W) {a.microbatch} (stage {k})"))
        self.held -= st.saved[k] + st.pending[k]
        self.held += R * st.sbh * (k < last and k not in st.local_next)  # its sent output, until the step ends
        self.in_flight -= 1
        self.grads_live = True

    def _g(self) -> float:
        return self.grads if self.grads_live else 0.0


def _device(run: Run, layout: ParallelLayout, bounds: list[tuple[int, int]], st: _Stages, d: int) -> dict:
    """GPU ``d``'s figures: its stages' parameters, the walk of its schedule, its peak and what makes it."""
    parts, last, M = run.arch.pipeline_parts, len(bounds) - 1, layout.microbatches
    schedule = run.opts.pp_schedule
    mine = layout.stages_of(d)  # loop placement (s % P), or zbv's V (d and 2P-1-d)
    n_d = sum(_stage_params(parts, bounds, k, mine) for k in mine)
    grads = BYTES_PER_PARAM["gradients"] * n_d

    def largest_weight(k: int) -> int:  # elements of the largest weight of stage k (a W's gradient before it is added)
        return parts["vocab_x_hidden"] if k in (0, last) else parts["largest_block_param"]

    # interleaved and zbv run on torch's _PipelineScheduleRuntime, which waits for its sends only when the step ends: a
    # stage output sent to another GPU, or an input gradient sent back, stays referenced by its send until then
    walk = _Walk(st, grads, schedule in ("interleaved-1f1b", "zbv"), run.layers.recompute + run.layers.input_grad_backward,
                 largest_weight)
    for a in device_orders(schedule, layout.stages, M, layout.chunks)[d]:
        if a.kind == "F":
            walk.forward(a, last)
        elif a.kind == "B" or (a.kind == "I" and a.stage > 0) or (a.kind == "W" and a.stage == 0):
            walk.backward(a, last)
        elif a.kind == "W":
            walk.weight_grad(a, last)
    if last in mine and st.keeps:
        walk.moments.append((0.0, 2 * walk.retained, grads, 0.0,
                             f"end of step: the {M} micro-batches' logits concatenated (return_outputs)"))
    largest = parts["vocab_x_hidden"] if (0 in mine or last in mine) else parts["largest_block_param"]
    step_tmp = 4.0 * largest  # grad.float().pow(2), clipping norm
    if layout.replicas > 1:
        step_tmp += 4.0 * n_d  # _average_over_replicas flattens all gradients into one buffer
    if run.device == "cpu":
        step_tmp = max(step_tmp, cpu_adamw_temp_bytes(largest))  # single-tensor AdamW, after the norm
    walk.moments.append((walk.input_grads, walk.retained, grads, step_tmp, "optimizer step"))
    acts, logits, g, tmp, moment = max(walk.moments, key=lambda m: m[0] + m[1] + m[2] + m[3])
    static = (BYTES_PER_PARAM["parameters"] + BYTES_PER_PARAM["optimizer"]) * n_d + sum(st.buffers[k] for k in mine)
    return {
        "gpu": d, "stages": mine, "blocks": [list(bounds[k]) for k in mine], "params": n_d,
        "peak_in_flight": walk.peak_in_flight, "peak": static + acts + logits + g + tmp, "moment": moment,
        "activations": acts, "logits": logits, "gradients_live": g, "step_buffers": tmp,
        "receive_buffers": sum(st.buffers[k] for k in mine), "activations_per_microbatch": [st.saved[k] for k in mine],
        "logits_kept": st.pl * st.bsv * M if (last in mine and st.keeps) else 0.0,
    }


class PipelineMemory(EngineMemory):

    def states(self, s: StrategySpec, d: int, precision: str, optimizer: str = "adamw", in_backward: bool = False,
               master_weights: str = "fp32") -> States:
        b = {k: Fraction(v) for k, v in BYTES_PER_PARAM.items()}
        return States(b["parameters"], b["gradients"], b["optimizer"], "fp32 weights, grads and AdamW states of each stage's layers")

    def batch(self, cfg, world: int) -> tuple[int, int]:
        """As `train --strategy pipeline` runs it: without --microbatches, its default micro-batches per stage."""
        micro, accum, _ = cfg.with_pipeline_microbatches(world)[0].resolve_batch(data_parallel_size(cfg, world, cfg.strategy))
        return micro, accum

    def per_gpu(self, run: Run) -> PerGpu:
        arch = run.arch
        if arch.pipeline_parts is None:
            raise NotApplicable(f"pipeline parallelism in shardlab supports GPT-2, BLOOM and Llama-style models, not {arch.family}",
                                "use another strategy")
        layout = pipeline_layout(run.cfg, run.gpus_per_node, run.nodes, arch.layers, run.accum, run.spec.name)
        bounds = pipeline_split(arch, run.cfg.seq_len, layout.virtual_stages)
        st = _stages(run, layout, bounds)
        per_device = [_device(run, layout, bounds, st, d) for d in range(layout.stages)]
        worst = max(per_device, key=lambda e: e["peak"])
        n_w = worst["params"]
        gpu = {
            "parameters": float(BYTES_PER_PARAM["parameters"] * n_w),
            "gradients": float(BYTES_PER_PARAM["gradients"] * n_w),
            "optimizer": float(BYTES_PER_PARAM["optimizer"] * n_w),
            "activations": float(worst["activations"]),
            "logits (loss)": float(worst["logits"]),
            "temporary": float(worst["receive_buffers"]),
            "step buffers": float(worst["step_buffers"]),
        }
        return PerGpu(float(worst["peak"]), worst["moment"], gpu, 16.0 * n_w / arch.n_params,
                      self._notes(run, layout, bounds, worst, per_device, st), per_device)

    @staticmethod
    def _notes(run: Run, layout: ParallelLayout, bounds, worst: dict, per_device: list[dict], st: _Stages) -> list[str]:
        schedule, M, last = run.opts.pp_schedule, layout.microbatches, len(bounds) - 1
        where = (f"{schedule}, {layout.stages} GPU(s) per pipeline x {layout.replicas} replica(s), {M} micro-batches; fp32 "
                 f"weights, grads and AdamW states of each stage's layers")
        if schedule == "zbv":  # backward split into I and W (pipesim.schedules.SPLIT_BACKWARD)
            where += ("; zbv: 2 stages per GPU in a V, each micro-batch's activations held until its weight gradient (W), "
                      "and from its input gradient (I) on the gradients at its weights' outputs")
        notes = [where, f"split (blocks per stage, the strategy's split_blocks): {[list(x) for x in bounds]}",
                 f"worst GPU {worst['gpu']} (stages {worst['stages']}): peak at {worst['moment']}"]
        if run.precision != "fp32":
            notes.append(f"--precision {run.precision}: each stage computes under autocast over fp32 weights; the activations "
                         "passed between stages stay fp32")
        if st.keeps:
            kept = per_device[layout.stage_position(last)]["logits_kept"]
            notes.append(f"the last stage (GPU {last % layout.stages}) keeps {M} x {st.pl}·b·s·V of logits ({kept / 2**30:.2f} GiB) "
                         "for schedule.step's return value (this torch's schedule.step has no return_outputs to decline it), "
                         "plus their concatenation at the end of the step")
        return notes
