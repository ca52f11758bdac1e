"""Memory of `--strategy pipeline` per GPU, as strategies/pipeline.py and torch.distributed.pipelining run it.

Per GPU of one pipeline (P GPUs, V model chunks each under interleaved 1F1B, M micro-batches per step):

* **Model states of its stages only.** The split is the strategy's own (``split_blocks``: ``stage_costs`` over the
  strategy's per-layer and LM-head FLOP costs), so plan and training cut the model in the same place.
  The first stage holds the embedding, the last the final norm and LM head; a tied embedding is a
  second copy on the last GPU. The pipeline uses torch's AdamW over fp32 weights:
  4 (weights) + 4 (gradients) + 8 (m, v) bytes per parameter.
* **Autocast inside each stage** (``Stage.forward``) under bf16, over fp32 weights: the layers save what
  they save under dp's autocast (planner's 'autocast' mode), the residual stream between stages stays fp32,
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
  (memory.weight_grad_input_bytes per layer; the logits' gradient on the last stage). Gradients exist from the
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
  one layer's temporaries (memory.layer_backward_bytes) and, with checkpointing, one recomputed layer.
* The peak of a GPU is the largest of: every forward's end, every backward's start (grads live after
  the first backward of the step), the merge of the logits at the end of the step, and the optimizer
  step (gradients flattened for the all-reduce across pipeline replicas when there are several).
The worst GPU is the plan's per-GPU peak; ``StrategyPlan.stages`` lists every GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..errors import UserError
from ..layout import LayoutError, ParallelLayout
from ..pipesim.schedules import device_orders
from ..strategies.spec import find
from .memory import (
    CUDA_CONTEXT_BYTES,
    PROCESS_RSS_BYTES,
    Arch,
    GiB,
    StrategyPlan,
    activation_bytes,
    cpu_adamw_temp_bytes,
    embed_bytes,
    final_bytes,
    input_grad_backward_bytes,
    layer_backward_bytes,
    weight_grad_input_bytes,
)

if TYPE_CHECKING:
    from ..config import RunConfig

BYTES_PER_PARAM = {"parameters": 4, "gradients": 4, "optimizer": 8}  # fp32 weights, grads, AdamW m and v


class PipelineNotApplicable(UserError):
    """The pipeline strategy cannot run this model / world (plan leaves it out of a full plan)."""


def pipeline_split(arch: "Arch", seq_len: int, n_stages: int) -> list[tuple[int, int]]:
    """The [start, end) blocks of every (virtual) stage: strategies/pipeline.py's own split_blocks."""
    from ..strategies.pipeline import split_blocks  # lazy: the strategy imports torch.distributed; a plan needs only its split

    shim = SimpleNamespace(  # what split_blocks reads of an HF config (rms_norm_eps: how layout.model_family tells Llama-style)
        hidden_size=arch.hidden, vocab_size=arch.vocab, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        intermediate_size=arch.ffn, **({"rms_norm_eps": 1e-5} if arch.family == "llama" else {}))
    return split_blocks(shim, arch.layers, seq_len, n_stages)


def pipeline_layout(cfg: "RunConfig", gpus_per_node: int, nodes: int, layers: int, microbatches: int) -> "ParallelLayout":
    """The layout `train --strategy pipeline` would run ``cfg`` in, its shape errors as PipelineNotApplicable (a full
    plan leaves the pipeline out). Any M is priced: what torch's schedules refuse, `train` refuses."""
    try:
        return ParallelLayout.from_config(cfg, gpus_per_node * nodes, nodes, layers, microbatches=microbatches, check_schedule=False,
                                          unit="GPUs", strategy=find(engine="pipelining"))  # a full plan prices the pipeline row of any config
    except LayoutError as err:
        raise PipelineNotApplicable(err.message, err.hint) from None


def pipeline_strategy_plan(arch: "Arch", cfg: "RunConfig", micro: int, accum: int, precision: str, gpus_per_node: int,
                           nodes: int, checkpointing: bool, device: str = "cuda") -> "StrategyPlan":
    parts = arch.pipeline_parts
    if parts is None:
        raise PipelineNotApplicable(f"pipeline parallelism in shardlab supports GPT-2, BLOOM and Llama-style models, not {arch.family}",
                                    "use another strategy")
    layout = pipeline_layout(cfg, gpus_per_node, nodes, arch.layers, accum)
    P, V, replicas = layout.stages, layout.chunks, layout.replicas
    n_stages, M = layout.virtual_stages, layout.microbatches
    schedule = cfg.strategy_options.pp_schedule
    bounds = pipeline_split(arch, cfg.seq_len, n_stages)
    b, s, h, vocab = micro, cfg.seq_len, arch.hidden, arch.vocab
    mode = "fp32" if precision == "fp32" else "autocast"  # Stage.forward's autocast (fp16 is refused by the strategy)
    act = activation_bytes(arch, micro, s, mode, device, checkpointing)
    r = 4  # fp32 residual stream: stage inputs, outputs and their gradients (fp32 under autocast too)
    pl = 4 if mode == "fp32" else 2  # the last stage's output: the logits, in the compute dtype
    sbh, bsv = float(s * b * h), float(b * s * vocab)
    last = n_stages - 1

    from ..strategies.pipeline import step_keeps_outputs  # lazy, as split_blocks above

    keeps = step_keeps_outputs()  # the last stage's logits kept in output_chunks until the step ends
    split = schedule == "zbv"  # backward split into I and W (pipesim.schedules.SPLIT_BACKWARD)
    # zbv's turn of the V: stage P-1's output is stage P's input on the same GPU, passed by reference (set_local_fwd_input
    # makes it stage P's receive buffer), so it is counted once, as that buffer
    local_next = {k for k in range(last) if layout.stage_position(k) == layout.stage_position(k + 1)}
    # interleaved and zbv run on torch's _PipelineScheduleRuntime, which waits for its sends only when the step ends: a
    # stage output sent to another GPU, or an input gradient sent back, stays referenced by its send until then
    runtime = schedule in ("interleaved-1f1b", "zbv")
    saved, transient, buffers, pending = [], [], [], []
    for k, (lo, hi) in enumerate(bounds):
        x = (hi - lo) * act.per_layer
        x += embed_bytes(arch, mode, device) * sbh if k == 0 else -r * sbh  # a later stage's saved input is its receive buffer
        # last: log-softmax out, and (when not kept in output_chunks) the logits in fwd_cache; else: the output in fwd_cache
        x += (final_bytes(arch, mode, device) * sbh + (4 + (0 if keeps else pl)) * bsv) if k == last else (0 if k in local_next else r * sbh)
        if mode == "autocast":  # each forward casts the stage's matmul weights anew (the cache ends with the autocast
            # region) and autograd keeps those 16-bit copies until that micro-batch's backward; embeddings are not cast,
            # and checkpointed blocks keep only their input (the copies are made again in the recompute)
            x += 2.0 * ((0 if checkpointing else sum(parts["blocks"][lo:hi])) + (parts["head"] if k == last else 0))
        saved.append(x)
        # backward: the loss' gradients at the head first, then each layer's (recomputed, with checkpointing) temporaries
        layer_bwd = act.recompute + layer_backward_bytes(arch, mode) * sbh
        transient.append(max(8 * bsv, layer_bwd) if k == last else layer_bwd)
        buffers.append(M * r * sbh * ((k > 0) + (k < last)))
        # split backward, from I to W: every weight's output gradient (the last stage's logits' too, and its final norm's)
        pending.append((hi - lo) * weight_grad_input_bytes(arch, mode) * sbh + ((pl * bsv + r * sbh) if k == last else 0.0))

    def stage_params(k: int, on_device: list[int]) -> int:
        lo, hi = bounds[k]
        n = sum(parts["blocks"][lo:hi])
        if k == 0:
            n += parts["embed"]
        if k == last:
            n += parts["final_norm"] + parts["head"]
            if parts["tied"] and 0 in on_device:
                n -= parts["vocab_x_hidden"]  # the tied weight is one Parameter on one device
        return n

    i_transient = act.recompute + input_grad_backward_bytes(arch, mode) * sbh  # one layer's I (recomputed first if checkpointed)

    def largest_weight(k: int) -> int:  # elements of the largest weight of stage k (a W's gradient before it is added)
        return parts["vocab_x_hidden"] if k in (0, last) else parts["largest_block_param"]

    per_device = []
    for d in range(P):
        mine = layout.stages_of(d)  # loop placement (s % P), or zbv's V (d and 2P-1-d)
        n_d = sum(stage_params(k, mine) for k in mine)
        grads = BYTES_PER_PARAM["gradients"] * n_d
        held = retained = 0.0
        input_grads = 0.0  # zbv: the input gradients its I's left on this GPU's receive buffers (.grad) this step
        grads_live = False
        in_flight = peak_in_flight = 0
        # candidate moments: (saved activations, logits + loss tensors, gradients, step temporaries, what)
        moments = []
        for a in device_orders(schedule, P, M, V)[d]:
            g = grads if grads_live else 0.0
            if a.kind == "F":
                held += saved[a.stage]
                retained += pl * bsv if (a.stage == last and keeps) else 0.0
                in_flight += 1
                peak_in_flight = max(peak_in_flight, in_flight)
                moments.append((held, retained, g, 0.0, f"end of forward {a.microbatch} (stage {a.stage})"))
            elif a.kind == "B" or (a.kind == "I" and a.stage > 0) or (a.kind == "W" and a.stage == 0):
                # a full backward, an input gradient, or the first stage's W (its whole backward: its I is empty)
                loss_tmp = 8 * bsv if (a.stage == last and 8 * bsv >= transient[a.stage]) else 0.0
                what = {"B": "backward", "I": "input gradient (I)", "W": "weight gradient (W, the stage's whole backward)"}[a.kind]
                moments.append((held + transient[a.stage] - loss_tmp, retained + loss_tmp, g, 0.0,
                                f"start of {what} {a.microbatch} (stage {a.stage}, {in_flight} micro-batches in flight)"))
                if a.kind == "I":  # the activations stay for the W; the gradients at the weights' outputs join them
                    # its peak: the stage's weights' output gradients all captured, its first layer's backward running
                    # with nothing freed (retain_graph)
                    moments.append((held + pending[a.stage] + i_transient, retained, g, 0.0,
                                    f"input gradient (I) {a.microbatch} (stage {a.stage}: the W's inputs held, nothing freed)"))
                    held += pending[a.stage]
                    if a.stage - 1 not in local_next:  # torch's input backward leaves the input's gradient on the receive
                        held += r * sbh  # buffer (.grad) until the next step begins (the turn of the V's is stage P-1's buffer)
                        input_grads += r * sbh
                else:
                    held -= saved[a.stage]
                    held += r * sbh * runtime * ((a.stage < last and a.stage not in local_next)  # its sent output
                                                 + (a.kind == "B" and a.stage > 0))  # and its sent input gradient
                    in_flight -= 1
                    grads_live = True
            elif a.kind == "W" and a.stage > 0:  # the weight gradient: each weight's gradient made, then added to .grad
                w_tmp = 4.0 * largest_weight(a.stage) if grads_live else 0.0  # the first W assigns .grad, later ones add to it
                moments.append((held + w_tmp, retained, g, 0.0, f"weight gradient (W) {a.microbatch} (stage {a.stage})"))
                held -= saved[a.stage] + pending[a.stage]
                held += r * sbh * (a.stage < last and a.stage not in local_next)  # its sent output, until the step ends
                in_flight -= 1
                grads_live = True
        if last in mine and keeps:
            moments.append((0.0, 2 * retained, grads, 0.0, f"end of step: the {M} micro-batches' logits concatenated (return_outputs)"))
        largest = parts["vocab_x_hidden"] if (0 in mine or last in mine) else parts["largest_block_param"]
        step_tmp = 4.0 * largest  # grad.float().pow(2), clipping norm
        if replicas > 1:
            step_tmp += 4.0 * n_d  # _average_over_replicas flattens all gradients into one buffer
        if device == "cpu":
            step_tmp = max(step_tmp, cpu_adamw_temp_bytes(largest))  # single-tensor AdamW, after the norm
        moments.append((input_grads, retained, grads, step_tmp, "optimizer step"))
        acts, logits, g, tmp, moment = max(moments, key=lambda m: m[0] + m[1] + m[2] + m[3])
        static = (BYTES_PER_PARAM["parameters"] + BYTES_PER_PARAM["optimizer"]) * n_d + sum(buffers[k] for k in mine)
        per_device.append({
            "gpu": d, "stages": mine, "blocks": [list(bounds[k]) for k in mine], "params": n_d,
            "peak_in_flight": peak_in_flight, "peak": static + acts + logits + g + tmp, "moment": moment,
            "activations": acts, "logits": logits, "gradients_live": g, "step_buffers": tmp,
            "receive_buffers": sum(buffers[k] for k in mine), "activations_per_microbatch": [saved[k] for k in mine],
            "logits_kept": pl * bsv * M if (last in mine and keeps) else 0.0,
        })
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
        "overhead (not in allocated)": float(CUDA_CONTEXT_BYTES),
    }
    where = (f"{schedule}, {P} GPU(s) per pipeline x {replicas} replica(s), {M} micro-batches; fp32 weights, grads and "
             f"AdamW states of each stage's layers")
    if split:
        where += ("; zbv: 2 stages per GPU in a V, each micro-batch's activations held until its weight gradient (W), "
                  "and from its input gradient (I) on the gradients at its weights' outputs")
    notes = [
        f"split (blocks per stage, the strategy's split_blocks): {[list(x) for x in bounds]}",
        f"worst GPU {worst['gpu']} (stages {worst['stages']}): peak at {worst['moment']}",
    ]
    if precision != "fp32":
        notes.append(f"--precision {precision}: each stage computes under autocast over fp32 weights; the activations "
                     "passed between stages stay fp32")
    if keeps:
        kept = per_device[layout.stage_position(last)]["logits_kept"]
        notes.append(f"the last stage (GPU {last % P}) keeps {M} x {pl}·b·s·V of logits ({kept / GiB:.2f} GiB) for schedule.step's "
                     "return value (this torch's schedule.step has no return_outputs to decline it), plus their "
                     "concatenation at the end of the step")
    cpu_detail = {
        "model built in fp32 on the CPU by every rank (load time)": 4.0 * arch.n_params * gpus_per_node,
        "process (python, torch, CUDA libs)": float(PROCESS_RSS_BYTES * gpus_per_node),
    }
    return StrategyPlan(
        strategy=find(engine="pipelining"), gpu=gpu, gpu_peak=float(worst["peak"]), peak_moment=worst["moment"],
        cpu_per_node=sum(cpu_detail.values()), cpu_detail=cpu_detail, nvme_per_node=0.0,
        model_state_bytes_per_param=16.0 * n_w / arch.n_params, paper_bytes_per_param=None,
        deepspeed_gpu=None, deepspeed_cpu=None, notes=[where] + notes, stages=per_device,
    )
