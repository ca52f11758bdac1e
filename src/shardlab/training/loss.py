"""The causal-LM loss, computed outside the model so that torch.compile can fuse it.

transformers' ``ForCausalLMLoss`` upcasts the whole logits tensor to fp32 and runs log-softmax
over it. For b·s tokens and a vocabulary of V that is an fp32 copy (4·b·s·V bytes), the saved
fp32 log-probabilities (4·b·s·V) and, in backward, their gradient and the logits' gradient: about
twelve bytes per logit at the start of backward and half a dozen full passes over memory. On
GPT-2 (V = 50,257), micro 8 × 1024 tokens, that is 4.9 GB; on BLOOM (V = 250,880) five times more.

``causal_lm_loss`` is the same mathematics (the fp32 log-softmax of the model's logits, labels
shifted by one, positions labelled -100 ignored, mean over the rest) written as one function.
Compiled by torch.compile (inductor) it becomes one reduction kernel forward and one pointwise
kernel backward that read the 16-bit logits and write 16-bit gradients, so the fp32 copies are
never materialised. The loss keeps fp32 accuracy: each logit is upcast in registers.

``loss_kernel`` in the run config picks it: ``compiled`` (this module, torch.compile'd), ``hf``
(the model computes its own loss, as the bare loops do), ``liger`` (below), ``auto`` = compiled on CUDA, hf on CPU
(inductor's compile time on a CPU would outweigh the gain for the short runs CPUs do). Under
``--compile`` too the loss stays apart from the model's graph: on an H100 (gpt2-medium, micro 16)
the loss inside the compiled graph cost 1.4 GiB more peak memory and ran 0.9% slower
(benchmarks/results/*-h100-session3/foundation-compile-call1/).

``liger`` goes one step further: no logits at all. The model runs with its output head skipped (``head_skipped``:
its forward returns its input, so the model's own forward, under whatever wrapper the strategy put around it, DDP,
a DeepSpeed engine or torch.compile, ends at the final hidden states), and Liger-Kernel's fused linear
cross-entropy (``LigerFusedLinearCrossEntropyLoss``, Triton) applies the head's weight chunk by chunk of tokens,
computing each chunk's logits, its cross-entropy and its gradients at once; the weight's gradient flows into the
head's own parameter, which is the input embedding's when the two are tied (GPT-2, BLOOM). It needs the head's
weight whole on the GPU: not FSDP2 nor ZeRO-3, whose parameters are shards (``check_loss_kernel``), and a CUDA GPU
with liger_kernel installed (refused in preflight otherwise). Its weight-gradient buffer is fp32
(``accum_dtype``) so that 16-bit engines (DeepSpeed) do not round it at every chunk.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..data.blocks import IGNORE  # transformers' ignore index: padding and (QA answer-only) prompt positions
from ..errors import UserError

# Lazy import below: liger_kernel is optional (the `gpu` extra) and CUDA-only.


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts: token t predicts t+1; the last position predicts nothing (IGNORE)."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ForCausalLMLoss (num_items_in_batch=None): mean token cross-entropy, fp32."""
    shift_labels = next_token_labels(labels)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=IGNORE)


def eval_chunk_tokens(vocab: int, chunk_mib: int) -> int | None:
    """Tokens per chunk of ``chunked_causal_lm_loss``: as many as keep one chunk's fp32 working memory (its fp32 copy of
    the logits and the fp32 log-softmax, 8 B a logit) within ``chunk_mib`` MiB; None (the whole batch at once) for 0."""
    return max(1, int(chunk_mib * 2**20 // (8 * vocab))) if chunk_mib > 0 else None


def chunked_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, chunk_mib: int) -> torch.Tensor:
    """causal_lm_loss for a forward without autograd (eval), a chunk of tokens at a time.

    causal_lm_loss upcasts the whole logits tensor and runs an fp32 log-softmax over it: 10 B a logit alive at once in a
    16-bit run (the logits, their fp32 copy, the log-probabilities). For BLOOM's 250,880-token vocabulary that is 2.5 GB a
    row of 1,024 tokens, so with checkpointing the eval forward could be a run's GPU peak (bloom-7b1 zero3_offload, one
    GPU: 18% above training's, benchmarks/results/*-h100-z3off-plan). Here only one chunk's fp32 copies exist
    beside the model's own logits (``eval_chunk_tokens``). The same mean over the non-ignored positions, summed in fp32
    chunk by chunk."""
    shift_labels = next_token_labels(labels).reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    step = eval_chunk_tokens(flat.shape[1], chunk_mib) or flat.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], step):
        total += F.cross_entropy(flat[start:start + step].float(), shift_labels[start:start + step],
                                 ignore_index=IGNORE, reduction="sum")
    return total / (shift_labels != IGNORE).sum().clamp_min(1)


def router_aux_coef(model) -> float:
    """The weight transformers gives a mixture-of-experts model's router load-balancing loss when it computes the
    loss itself (Mixtral, Qwen-MoE, OLMoE, ...: `router_aux_loss_coef`; JetMoE: `aux_loss_coef`)."""
    config = getattr(model, "config", None)
    for owner, name in ((model, "router_aux_loss_coef"), (model, "aux_loss_coef"), (config, "router_aux_loss_coef"),
                        (getattr(config, "text_config", None), "router_aux_loss_coef")):
        value = getattr(owner, name, None)
        if isinstance(value, (int, float)):
            return float(value)

    raise UserError(f"{type(model).__name__} returns a router aux loss but no coefficient shardlab knows for it",
                    "train it with --set loss_kernel=hf (the model's own loss)")


def model_loss(outputs, labels: torch.Tensor, loss_fn: Callable, model) -> torch.Tensor:
    """`loss_fn` on the logits plus what transformers adds to its own loss: a mixture-of-experts router's
    load-balancing term (`aux_loss`, present when config.output_router_logits is on)."""
    loss = loss_fn(outputs.logits, labels)
    aux = getattr(outputs, "aux_loss", None)
    if aux is not None:
        loss = loss + router_aux_coef(model) * aux.to(loss.device)
    return loss


def resolve_loss_kernel(choice: str, device_type: str) -> str:
    """'compiled', 'hf' or 'liger' for the `loss_kernel` setting on this device."""
    if choice != "auto":
        return choice
    return "compiled" if device_type == "cuda" else "hf"


# ---- liger: the output head fused with the loss -------------------------------------------------------------

# Config keys of models whose logits are transformed after the head (Gemma 2/3 soft-capping, Cohere's logit_scale,
# Granite's logits_scaling): the fused kernel would compute the loss of the untransformed logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_loss_kernel(choice: str, strategy_spec, device_type: str, hf_config=None) -> None:
    """Preflight: one-line refusal of a loss kernel this run cannot use (before any process or file exists)."""
    if choice != "liger":
        return

    if device_type != "cuda":
        raise UserError(f"loss_kernel 'liger' needs a CUDA GPU (Liger-Kernel's fused linear cross-entropy is Triton code) "
                        f"and this run is on the {device_type}", "drop --set loss_kernel=liger (auto picks the loss for this device)")
    name = strategy_spec.name
    if strategy_spec.own_loss:
        raise UserError(f"loss_kernel 'liger' does not apply to strategy {name!r}: its last stage computes the loss itself",
                        "drop --set loss_kernel=liger")
    if "params" in strategy_spec.sharded:
        raise UserError(f"loss_kernel 'liger' is not supported with strategy {name!r}: it shards the output head's weight, "
                        "which the fused loss needs whole", "use --set loss_kernel=compiled, or dp / zero0-2 for liger")
    for key in LOGIT_TRANSFORMS:
        if hf_config is not None and getattr(hf_config, key, None) not in (None, 1, 1.0):
            raise UserError(f"loss_kernel 'liger' would skip this model's {key} (its logits are transformed after the head)",
                            "use --set loss_kernel=compiled")
    try:
        fused_linear_cross_entropy()
    except ImportError as e:
        raise UserError(f"loss_kernel 'liger' needs Liger-Kernel, which does not import here ({e})",
                        "pip install 'liger-kernel>=0.8.5,<0.9' (shardlab's [gpu] extra)") from None


# Liger's transient logits budget, in multiples of tokens x hidden (its own default is 1). Each chunk of tokens
# re-reads and re-writes the whole fp32 weight-gradient accumulator (V x h), so the number of chunks, about V / (C h),
# sets that traffic: with C = 1, 50 chunks for GPT-2 (V / h = 49) and 62 for BLOOM-7b1 (8 GB per chunk, ~0.5 TB a
# step). C = 8 makes it 4-8 chunks, each holding about 8 x tokens x hidden logits (BLOOM micro 16: 1 GB in bf16,
# against 8 GB for the whole logits tensor and as much again for its gradient).
CHUNK_MEM_CONST = 8


def fused_linear_cross_entropy() -> Callable:
    """Liger-Kernel's fused linear cross-entropy as ``fn(hidden (N, H), weight (V, H), targets (N,), bias) -> mean loss``.
    Imported on first use: it imports Triton."""
    from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction

    def fused(hidden, weight, targets, bias=None):
        # the Function's positional arguments (liger 0.8.5): ce_weight, ignore_index, lse_square_scale, label_smoothing,
        # reduction, softcap, return_z_loss, accum_dtype (fp32: 16-bit weights would be rounded at every chunk),
        # use_token_scaling, return_token_accuracy, return_predicted_tokens, ce_impl, ce_mode, chunk_mem_const
        out = LigerFusedLinearCrossEntropyFunction.apply(
            hidden, weight, targets, bias, None, IGNORE, 0.0, 0.0, "mean", None, False, torch.float32,
            False, False, False, None, None, CHUNK_MEM_CONST)
        return out[0]

    return fused


def reference_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the fused kernel computes, written plainly (it materialises the logits): the head, then fp32 cross-entropy."""
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=IGNORE)


class HeadFusedLoss:
    """The loss on the final hidden states and the output head (``loss_kernel=liger``): the model is run with its head
    skipped (``head_skipped``) and ``fused`` applies the head's weight inside the loss, so no logits tensor exists.
    ``fused`` has reference_linear_cross_entropy's signature (tests pass that one on the CPU)."""

    def __init__(self, fused: Callable | None = None):
        self._fused = fused

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
        if self._fused is None:
            self._fused = fused_linear_cross_entropy()
        shift_labels = next_token_labels(labels)
        weight, bias = head.weight, head.bias
        if torch.is_autocast_enabled(hidden.device.type):
            # What autocast would do for the head's linear, done once here: inside the kernel autocast would cast the
            # fp32 weight again for every chunk (weight.t() is a view, which its cast cache skips). The cast's backward
            # hands the fp32 parameter (and, tied, the embedding) the gradient, as the head's own cast does.
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return self._fused(hidden.reshape(-1, hidden.shape[-1]), weight, shift_labels.reshape(-1), bias)


def _skippable_forward(self, x):
    return x if self.shardlab_skip else self._shardlab_head_class.forward(self, x)


_SKIPPABLE: dict[type, type] = {}


def output_head(model: nn.Module) -> nn.Module:
    """The model's output head (lm_head), checked to be one the fused loss can replace: a linear map with a weight."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        raise UserError(f"loss_kernel 'liger': {type(model).__name__} has no linear output head to fuse with the loss",
                        "use --set loss_kernel=compiled")
    return head


@contextlib.contextmanager
def head_skipped(head: nn.Module):
    """While inside, ``head``'s forward returns its input: the model's outputs.logits are the final hidden states.

    Done by giving the head (once) a subclass of its own class whose forward reads a flag, not by replacing the
    module: parameter names, state dicts, tied weights, DDP/DeepSpeed hooks and isinstance checks are unchanged, and
    torch.compile sees an ordinary module attribute (the flag is True whenever the compiled model runs)."""
    cls = type(head)
    if not hasattr(cls, "_shardlab_head_class"):
        sub = _SKIPPABLE.get(cls)
        if sub is None:
            sub = _SKIPPABLE[cls] = type(f"HeadSkippable{cls.__name__}", (cls,),
                                          {"forward": _skippable_forward, "_shardlab_head_class": cls})
        head.__class__ = sub
    head.shardlab_skip = True
    try:
        yield head
    finally:
        head.shardlab_skip = False


_compiled: Callable | None = None


def build(choice: str, device_type: str) -> Callable | None:
    """The loss function the strategy applies: None (the model computes its own), a function of the logits
    (compiled), or a HeadFusedLoss of the hidden states and the head (liger)."""
    global _compiled
    kernel = resolve_loss_kernel(choice, device_type)
    if kernel == "hf":
        return None
    if kernel == "liger":
        return HeadFusedLoss()
    if _compiled is None:
        _compiled = torch.compile(causal_lm_loss)
    return _compiled
