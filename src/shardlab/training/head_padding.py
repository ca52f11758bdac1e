"""The output head's matmul on a vocabulary padded to a multiple of 64, exactly (``pad_head``).

GPT-2's vocabulary has 50,257 tokens: a row of the logits (and of the head's weight) is an odd number of 16-bit
values, not 16-byte aligned, and cuBLAS runs the head's three GEMMs (forward, input and weight gradients) in sm75-era
``cutlass_75_tensorop_bf16_s1688gemm`` kernels instead of Hopper's: about 14% of an eager gpt2-medium step on an H100
(benchmarks/results/h100-profile-dp). With the vocabulary padded to 50,304 the bare eager loop ran 16.5% faster on an
H200; the compiled loop 2% (inductor pads shapes itself) (benchmarks/results/*-h200-speed-eager/, call 2).

nanoGPT pads the embedding itself and lets the padded tokens take part in the softmax; that changes the model. Here
only the matmul is padded: the head's weight (in its compute dtype) gets zero rows up to the multiple, the logits are
computed for the padded vocabulary, and the padded columns are sliced off before anything reads them. The logits are
the same numbers (the padded rows only add columns nobody sees), the loss and every gradient are unchanged (the slice's
backward gives the padded columns zero gradient, and the pad's backward drops the padded rows), and nothing else
changes: the parameter, its tied embedding, state dicts, checkpoints and exports keep the model's real vocabulary.

Done by giving the head (once) a subclass of its own class, as ``loss.head_skipped`` does, so that wrappers (DDP,
DeepSpeed, FSDP2, torch.compile), hooks and isinstance checks see the same module.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

MULTIPLE = 64  # nanoGPT's and llm.c's choice; 16-byte alignment needs only 8 bf16 values, 64 also suits the kernels' tiles

_PADDED: dict[type, type] = {}


def needs_padding(vocab: int) -> bool:
    return vocab % MULTIPLE != 0


def padded_vocab(vocab: int) -> int:
    return vocab + (-vocab % MULTIPLE)


def pads(cfg, device_type: str, loss_kernel: str, vocab: int) -> bool:
    """Whether a run pads a plain linear head of ``vocab`` rows: `pad_head` true, or None (auto) on a CUDA GPU, where
    the alignment decides the kernels; never for the liger loss (no head matmul of its own). The planner asks this."""
    if not needs_padding(vocab) or loss_kernel == "liger":
        return False
    return cfg.pad_head if cfg.pad_head is not None else device_type == "cuda"


def wanted(cfg, device_type: str, loss_kernel: str, head: nn.Module | None) -> bool:
    """Whether this run pads this head's matmul (``pads``); never a head that is no plain linear map."""
    return isinstance(head, nn.Linear) and pads(cfg, device_type, loss_kernel, _vocab(head))


def _vocab(head: nn.Linear) -> int:
    return getattr(head.weight, "ds_shape", head.weight.shape)[0]  # ZeRO-3 partitions leave p.shape empty (ds_shape: whole)


def _padded_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    vocab = weight.shape[0]
    if torch.is_autocast_enabled(x.device.type):  # what autocast's linear would do, done before padding (one copy)
        dtype = torch.get_autocast_dtype(x.device.type)
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    extra = padded_vocab(vocab) - vocab
    weight = F.pad(weight, (0, 0, 0, extra))
    bias = F.pad(bias, (0, extra)) if bias is not None else None
    return F.linear(x, weight, bias)[..., :vocab]


def pad_head(head: nn.Linear) -> nn.Linear:
    """Make ``head``'s forward compute its matmul on the padded vocabulary (in place; returns the head)."""
    cls = type(head)
    if getattr(cls, "_shardlab_padded", False):
        return head
    sub = _PADDED.get(cls)
    if sub is None:
        sub = _PADDED[cls] = type(f"VocabPadded{cls.__name__}", (cls,), {"forward": _padded_forward, "_shardlab_padded": True})
    head.__class__ = sub
    return head


def apply(model: nn.Module, cfg, device_type: str, loss_kernel: str) -> str | None:
    """Pad ``model``'s output head where `wanted`; returns the line the run logs, or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not wanted(cfg, device_type, loss_kernel, head):
        return None
    vocab = _vocab(head)
    pad_head(head)
    return (f"output head: its matmul runs on the vocabulary padded {vocab:,} -> {padded_vocab(vocab):,} (aligned "
            f"GEMM kernels), the padded logits sliced off: same logits and gradients (--set pad_head=false turns it off)")
