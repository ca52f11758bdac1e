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
(the model computes its own loss, as the bare loops do), ``auto`` = compiled on CUDA, hf on CPU
(inductor's compile time on a CPU would outweigh the gain for the short runs CPUs do). Under
``--compile`` too the loss stays apart from the model's graph: on an H100 (gpt2-medium, micro 16)
the loss inside the compiled graph cost 1.4 GiB more peak memory and ran 0.9% slower
(benchmarks/results/2026-11-21-h100-session3/foundation-compile-call1/).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from ..data.blocks import IGNORE  # transformers' ignore index: padding and (QA answer-only) prompt positions


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ForCausalLMLoss (num_items_in_batch=None): mean token cross-entropy, fp32."""
    shift_labels = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]  # token t predicts t+1
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=IGNORE)


def router_aux_coef(model) -> float:
    """The weight transformers gives a mixture-of-experts model's router load-balancing loss when it computes the
    loss itself (Mixtral, Qwen-MoE, OLMoE, ...: `router_aux_loss_coef`; JetMoE: `aux_loss_coef`)."""
    config = getattr(model, "config", None)
    for owner, name in ((model, "router_aux_loss_coef"), (model, "aux_loss_coef"), (config, "router_aux_loss_coef"),
                        (getattr(config, "text_config", None), "router_aux_loss_coef")):
        value = getattr(owner, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    from ..errors import UserError

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
    """'compiled' or 'hf' for the `loss_kernel` setting on this device."""
    if choice != "auto":
        return choice
    return "compiled" if device_type == "cuda" else "hf"


_compiled: Callable | None = None


def build(choice: str, device_type: str) -> Callable | None:
    """The loss function the strategy applies to the logits, or None: the model computes its own."""
    global _compiled
    if resolve_loss_kernel(choice, device_type) == "hf":
        return None
    if _compiled is None:
        _compiled = torch.compile(causal_lm_loss)
    return _compiled
