"""One rank's training step on its GPU, moment by moment: the activations of one micro-batch (memory.py) composed with
what the engine holds at each moment (its memory model's ``Held``, strategies/memory/).

The moments: the start of backward (every saved activation, the loss' gradients and what the engine holds then; a
checkpointed layer is not recomputed yet), the LM head's backward, a checkpointed layer's backward (its recomputation
and backward temporaries, the logits freed), the optimizer step (all gradients, step temporaries, no activations), the
engine's own moments once the activations are gone (a reduce, a tied embedding's second gradient), an eval forward
(the logits at the eval batch each rank gets and one chunk of the eager loss' fp32 copies) and, with 8-bit AdamW on a
GPU, the compile of its step before training, beside the weights alone. The peak is the largest.
"""

from __future__ import annotations

from ..strategies.memory import EIGHT_BIT_BLOCK, EIGHT_BIT_MIN_NUMEL, EngineMemory, Held, PerGpu, Run
from ..training.head_padding import padded_vocab, pads
from ..training.loss import eval_chunk_tokens
from .memory import Activations, Arch, layer_backward_bytes


def eight_bit_state_bytes(k: int) -> int:
    """GPU bytes of torchao AdamW8bit's two moments for a tensor of `k` elements (strategies.memory's layout)."""
    if k >= EIGHT_BIT_MIN_NUMEL and k % EIGHT_BIT_BLOCK == 0:
        return 2 * (k + 4 * (k // EIGHT_BIT_BLOCK))
    return 2 * 4 * k


def eight_bit_warmup_bytes(k: int, weight_bytes: int) -> int:
    """GPU bytes above the weights while shardlab compiles and autotunes torchao's 8-bit step for one parameter shape
    of `k` elements before training (loop/warm_8bit.py): a scratch copy of the weight, its gradient and its two
    moments, the autotuner's clones of what the step mutates (the weight and the moments), and the compiled step's own
    temporaries, measured as two weight-sized and two fp32 tensors of the shape. Measured on an H100/H200
    (benchmarks/results/*-h100-8bit-warmup): bloom-7b1's embedding with bf16 weights 21.17 GiB above the
    weights (22.12 B/element; this gives 22.06), gpt2-medium's with fp32 weights 1.505 under dp and 1.495 under fsdp
    (31.2-31.4 B/element; this gives 32.06)."""
    return 5 * weight_bytes * k + 2 * eight_bit_state_bytes(k) + 8 * k


def eval_loss_bytes(mode: str, tokens: int, vocab: int, chunk_mib: int) -> float:
    """GPU bytes of an eval forward's loss (no grad) over ``tokens`` rows of logits: the model's logits in the compute
    dtype, and beside them one chunk's fp32 working memory (loss.chunked_causal_lm_loss: the chunk's fp32 copy and
    fp32 log-softmax, 8 B a logit; 4 B for fp32 logits, whose ``.float()`` is the same tensor). ``chunk_mib`` 0 = the
    whole batch as one chunk, which is what the eager loss did before (measured at bloom-3b zero3_offload, 6 eval rows
    of 1024 tokens on one H200, benchmarks/results/*-h100-z3off-plan: 2,940 MiB + 2 x 5,880 MiB, 2 + 4 + 4 B a
    logit)."""
    logit, work = (4, 4) if mode == "fp32" else (2, 8)
    chunk = min(tokens, eval_chunk_tokens(vocab, chunk_mib) or tokens)
    return float(logit * tokens * vocab + work * chunk * vocab)


def autocast_copies(arch: Arch, mode: str, kernel: str, checkpointing: bool) -> tuple[float, float]:
    """Bytes of autocast's 16-bit weight copies (at the start of backward, and later in backward). Autocast casts each
    fp32 weight its ops use once a forward and autograd saves the copy for backward: every weight but the head's where
    the fused loss casts that one itself (liger: counted with the loss). bloom-7b1 ao_offload m32: +13.2 GiB measured.
    A checkpointed block saves none: its copies live in autocast's cache, which empties when the forward's autocast
    region ends, so backward holds the head's copy (and a recomputed block casts its own again: the layer moment)."""
    if mode != "autocast":
        return 0.0, 0.0
    head = (arch.pipeline_parts or {}).get("head", 0)
    weights = arch.n_params if arch.autocast_weight_params is None else arch.autocast_weight_params
    copies = 2.0 * (weights - (head if kernel == "liger" else 0))
    if not checkpointing or not arch.pipeline_parts:
        return copies, copies
    return copies, 0.0 if kernel == "liger" else 2.0 * head


def _backward_buffers(run: Run, held: Held, mode: str, kernel: str) -> dict[str, float]:
    """What is alive at the start of backward beside the activations: the engine's, after the head's padded weight
    or autocast's weight copies, which the run's precision and loss decide for every engine."""
    out: dict[str, float] = {}
    if mode != "autocast" and not run.cfg.compile and pads(run.cfg, run.device, kernel, run.arch.vocab):
        # training/head_padding.py runs the head's matmul on a copy of its weight padded to a multiple of 64 rows, which
        # the matmul saves for backward. Under autocast it takes the place of autocast's own 16-bit copy; over the
        # engine's own weights it is one more (gpt2 zero2_offload seq 512, one H100: 0.072 GiB at the peak,
        # benchmarks/diag/peak_snapshot.py, benchmarks/results/*-h100-plan-validation). Compiled, inductor recomputes the pad.
        out["pad_head: the head weight padded to a multiple of 64 rows (saved for backward)"] = float(
            run.lo * padded_vocab(run.arch.vocab) * run.arch.hidden)
    copies, _ = autocast_copies(run.arch, mode, kernel, run.checkpointing)
    if copies:
        out["autocast 16-bit weight copies (saved for backward)"] = copies
    return {**out, **held.backward}


def _moments(run: Run, held: Held, model: EngineMemory, act: Activations, mode: str, kernel: str,
             backward: dict[str, float], eval_rows: int) -> list[tuple[float, str]]:
    """(bytes, what) of every moment of the step (see the module docstring)."""
    arch, cfg = run.arch, run.cfg
    static = held.params + held.optimizer + sum(held.persistent.values())
    g_fb = held.grads_in_backward
    copies, copies_later = autocast_copies(arch, mode, kernel, run.checkpointing)
    # Start of backward: the saved activations and the loss' gradients, not yet a checkpointed layer's recomputation
    # (after the loss' and the head's backward have freed the logits). Counting both at once put bloom-7b1 zero3_offload
    # (micro 8, checkpointing) at 13.14 GiB where 12.25 was measured on 2 GPUs (benchmarks/results/*-h100-z3off-plan).
    fb = static + g_fb + act.peak - act.recompute + sum(backward.values())
    # a moment later: the loss' backward has left only the logits' gradient, and what the head's backward gathers; the
    # first gradient hook has run by then (the head's weight, or the final norm's where the head is tied)
    hooked = sum(held.from_first_grad.values())
    head = fb - act.logits_peak + act.logits_grad + sum(held.at_head.values()) + hooked - copies + copies_later
    out = [(fb, "start of backward (activations + loss gradients)"),
           (head, "backward at the LM head (activations + logits gradient + gathered root)")]
    if act.recompute:  # a checkpointed layer's recomputation and its backward's temporaries; of the loss, its gradient
        recast = 2.0 * arch.block_params if copies else 0.0  # the recomputed block's own autocast copies
        layer = (static + g_fb + act.layers + act.embed_final + act.recompute
                 + layer_backward_bytes(arch, mode) * float(run.micro * cfg.seq_len * arch.hidden)
                 + act.logits_grad + sum(backward.values()) + hooked - copies + copies_later + recast)
        out.append((layer, "backward of a checkpointed layer (its recomputation + backward temporaries)"))
    out.append((static + held.grads + sum(held.step.values()), "optimizer step (all gradients + step buffers)"))
    out += [(static + extra, what) for extra, what in held.after_backward]  # the activations are gone by then
    if eval_rows and kernel != "liger":  # liger evaluates through its fused kernel too: no logits
        # no activations kept, but the logits at the per-rank eval batch and one chunk of the loss' fp32 copies
        out.append((static + held.eval_gathered + eval_loss_bytes(mode, eval_rows * cfg.seq_len, arch.vocab, cfg.eval_loss_chunk_mib),
                    f"eval forward ({eval_rows} rows a rank: their logits and one loss chunk)"))
    if run.device == "cuda" and cfg.optimizer == "adamw8bit":
        # shardlab compiles and autotunes torchao's 8-bit step before training, one parameter shape at a time, beside
        # the weights alone (loop/warm_8bit.py): the moments and gradients of the run do not exist yet
        warm = max(eight_bit_warmup_bytes(k, 2 if run.bf16_master else 4) for k in model.optimizer_shapes(run))
        out.append((held.params + sum(held.persistent.values()) + warm,
                    "compiling the 8-bit step before training (a scratch weight, gradient, moments, the autotuner's "
                    "clones and the step's temporaries beside the weights)"))
    return out


def step_plan(run: Run, held: Held, model: EngineMemory, act: Activations, mode: str, kernel: str, eval_rows: int) -> PerGpu:
    """One rank's GPU over a step: its peak, the moment of it, the parts (states, activations, buffers) and every
    moment."""
    backward = _backward_buffers(run, held, mode, kernel)
    moments = _moments(run, held, model, act, mode, kernel, backward, eval_rows)
    peak, moment = max(moments, key=lambda m: m[0])
    parts = {
        "parameters": held.params,
        "gradients": held.grads,
        "optimizer": held.optimizer,
        "activations": act.layers + act.embed_final + act.recompute,
        "logits (loss)": act.logits_peak,
        "temporary": (sum(backward.values()) + sum(held.persistent.values()) + sum(held.at_head.values())
                      + sum(held.from_first_grad.values())),
        "step buffers": sum(held.step.values()),
    }
    detail = {**backward, **held.persistent, **held.at_head, **held.from_first_grad, **held.step}
    notes = [held.where] + held.notes + [f"{k}: {v / 2**30:.2f} GiB" for k, v in detail.items() if v]
    return PerGpu(peak, moment, parts, held.states_per_param, notes, moments={what: b for b, what in moments if b})

