"""Model FLOPs per token and model FLOPs utilisation (MFU) against known GPU peaks.

FLOPs per token (training: forward + backward), from PaLM (Chowdhery et al. 2022, arXiv:2204.02311),
appendix B, the same estimate nanoGPT's ``estimate_mfu`` uses::

    6 * N  +  12 * L * H * Q * T

``N`` counts the parameters that take part in matrix multiplications: every parameter except
embedding *look-ups* (position tables, and the token table unless it is tied to the LM head, whose
matmul is real work). ``6N`` is 2 FLOPs per multiply-add, times 3 for forward + backward (Kaplan et
al. 2020; Hoffmann et al. 2022, "Chinchilla", appendix F, which also counts the logits and
attention separately and agrees within a few per cent). ``12 L H Q T`` is attention's
``Q K^T`` and ``softmax . V`` for ``L`` layers, ``H`` heads of width ``Q`` and sequence length
``T``, counted over the full ``T x T`` square as PaLM and nanoGPT do (a causal kernel skips about
half of it; MFU stays comparable with published numbers this way). Activation recomputation and
padding are not model FLOPs: MFU uses the useful (non-pad) tokens.

Peaks are the vendors' *dense* tensor-core figures (datasheets quote most of them "with sparsity",
twice the dense number; those are halved here) per precision. fp32 without TF32 runs on the CUDA
cores, so its peak is the plain FP32 figure. A device not in ``GPU_PEAKS`` (the CPU too) gets no
MFU at all: ``None``, never a guess. This table is the one source of truth for device peaks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak TFLOP/s of one GPU model by math mode, and where the numbers come from."""

    name: str
    pattern: str  # regex searched in torch.cuda.get_device_name() / NVML's name
    fp32: float  # CUDA cores, no tensor cores
    tf32: float | None  # tensor cores, dense
    bf16: float | None  # tensor cores, dense, fp32 accumulate
    fp16: float | None  # tensor cores, dense, fp32 accumulate
    source: str


# Ordered: the first pattern that matches wins (so "H100 PCIe" is tested before the SXM pattern).
GPU_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak("H100 PCIe", r"\bH100\b.*\bPCIe\b", 51.2, 378.0, 756.0, 756.0,
               "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'H100 PCIe' (dense; datasheet 1,513 TFLOPS BF16 is with sparsity)"),
    DevicePeak("H100 SXM5", r"\bH100\b.*\b(SXM|HBM3)\b", 66.9, 494.7, 989.4, 989.4,
               "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'H100 SXM5' (dense; datasheet 1,979 TFLOPS BF16 is with sparsity)"),
    DevicePeak("H200 NVL", r"\bH200 NVL\b", 60.0, 417.5, 835.5, 835.5,
               "NVIDIA H200 datasheet, H200 NVL column: FP32 60, TF32 835, BF16/FP16 1,671 TFLOPS with sparsity (halved)"),
    DevicePeak("H200 SXM", r"\bH200\b", 67.0, 494.5, 989.5, 989.5,
               "NVIDIA H200 datasheet, H200 SXM column: FP32 67, TF32 989, BF16/FP16 1,979 TFLOPS with sparsity (halved)"),
    DevicePeak("A100 (40/80 GB, SXM/PCIe)", r"\bA100\b", 19.5, 156.0, 312.0, 312.0,
               "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS (dense)"),
    DevicePeak("L40S", r"\bL40S\b", 91.6, 183.0, 362.05, 362.05,
               "NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05 TFLOPS (dense; 366/733 with sparsity)"),
    DevicePeak("L4", r"\bL4\b", 30.3, 60.0, 121.0, 121.0,
               "NVIDIA L4 datasheet: FP32 30.3; TF32 120, BF16/FP16 242 TFLOPS with sparsity (halved)"),
    DevicePeak("A10", r"\bA10\b", 31.2, 62.5, 125.0, 125.0,
               "NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 TFLOPS (dense; 125/250 with sparsity)"),
    DevicePeak("V100S PCIe", r"\bV100S\b", 16.4, None, None, 130.0,
               "NVIDIA V100 datasheet, V100S PCIe: FP32 16.4, Tensor (FP16) 130 TFLOPS; no TF32/BF16"),
    DevicePeak("V100 SXM2", r"\bV100-SXM2\b", 15.7, None, None, 125.0,
               "NVIDIA V100 datasheet, V100 SXM2: FP32 15.7, Tensor (FP16) 125 TFLOPS; no TF32/BF16"),
    DevicePeak("V100 PCIe", r"\bV100-PCIE\b", 14.0, None, None, 112.0,
               "NVIDIA V100 datasheet, V100 PCIe: FP32 14, Tensor (FP16) 112 TFLOPS; no TF32/BF16"),
    DevicePeak("T4", r"\bT4\b", 8.1, None, None, 65.0,
               "NVIDIA T4 datasheet: FP32 8.1, mixed precision (FP16/FP32) 65 TFLOPS; no TF32/BF16"),
    DevicePeak("GeForce RTX 4090", r"\bRTX 4090$", 82.6, 82.6, 165.2, 165.2,
               "NVIDIA Ada Lovelace architecture whitepaper, appendix table: FP32 82.6, TF32 82.6, BF16/FP16 with FP32 accumulate 165.2 TFLOPS (dense)"),
    DevicePeak("GeForce RTX 3090", r"\bRTX 3090$", 35.6, 35.6, 71.0, 71.0,
               "NVIDIA Ampere GA102 GPU architecture whitepaper: FP32 35.6, TF32 35.6, BF16/FP16 with FP32 accumulate 71 TFLOPS (dense)"),
)


def find_peak(device_name: str | None) -> DevicePeak | None:
    """The table entry for a device name as torch or NVML reports it, or None when unknown."""
    if not device_name:
        return None
    for entry in GPU_PEAKS:
        if re.search(entry.pattern, device_name.strip()):
            return entry
    return None


def math_mode(precision: str, tf32_enabled: bool = False) -> str:
    """The peak column a precision runs its matmuls on: fp32 is tf32 only where TF32 is switched on."""
    if precision == "fp32":
        return "tf32" if tf32_enabled else "fp32"
    return precision


def peak_tflops(device_name: str | None, precision: str, tf32_enabled: bool = False) -> float | None:
    """Dense peak TFLOP/s of one device for the precision in use; None when the device or mode is unknown."""
    entry = find_peak(device_name)
    if entry is None:
        return None
    return getattr(entry, math_mode(precision, tf32_enabled))


# --------------------------------------------------------------------------------------------------
# FLOPs of the model


def full_numel(p: Any) -> int:
    """A parameter's element count as the model defines it: a ZeRO-3 partition's full size (ds_numel), a bitsandbytes
    4-bit weight's unpacked shape (its quant_state), else its own numel."""
    state = getattr(p, "quant_state", None)
    if getattr(p, "ds_numel", 0):
        return int(p.ds_numel)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(torch.Size(state.shape).numel())
    return int(p.numel())


def matmul_params(model: Any) -> int:
    """Parameters that take part in matmuls: all, minus embedding look-up tables not tied to the LM head."""
    return sum(matmul_split(model))


def matmul_split(model: Any) -> tuple[int, int]:
    """(frozen, trainable) matmul parameters (``matmul_params`` split by requires_grad): a --peft run's frozen base and
    its adapters, which cost different FLOPs per token (``flops_per_token``)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_weight = getattr(out_emb, "weight", None)
    lookups: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight is not out_weight:
            lookups.add(id(module.weight))
    seen: set[int] = set()
    frozen = trainable = 0
    for p in model.parameters():
        if id(p) in seen or id(p) in lookups:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += full_numel(p)
        else:
            frozen += full_numel(p)
    return frozen, trainable


def attention_width(hf_config: Any) -> tuple[int, int]:
    """(layers, heads x head width) from a transformers config."""
    layers = getattr(hf_config, "num_hidden_layers", None) or hf_config.n_layer
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    heads = getattr(hf_config, "num_attention_heads", None) or hf_config.n_head
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return int(layers), int(heads * head_dim)


def flops_per_token(n_matmul_params: int, layers: int, attn_width: int, seq_len: int, frozen_params: int = 0) -> int:
    """PaLM appendix B: 6N + 12 L (H Q) T, training FLOPs per token. ``frozen_params`` more matmul parameters that get
    no weight gradient (a --peft run's base): 4 each, the forward's 2 and the input gradient's 2 that backward still
    needs to reach the adapters below them (the first layer's input gradient, which nothing needs, is counted too:
    under 1/L of the base's share). Attention keeps its full forward and backward: it has no weights to skip."""
    return 6 * n_matmul_params + 4 * frozen_params + 12 * layers * attn_width * seq_len


FULL_COUNT = "6 x params per token + attention"
ADAPTER_COUNT = "4 x frozen + 6 x trainable params per token + attention"


def model_flops(model: Any, seq_len: int) -> dict[str, Any]:
    """What a run needs to compute its MFU later: N (matmul parameters), FLOPs per token and which FLOPs they count
    (``flops_counted``). A model with frozen weights (--peft) counts them at 4 FLOPs per token, not 6."""
    frozen, trainable = matmul_split(model)
    layers, width = attention_width(model.config)
    out: dict[str, Any] = {"matmul_params": frozen + trainable}
    if frozen:
        out.update(trainable_matmul_params=trainable, flops_counted=ADAPTER_COUNT,
                   flops_per_token=flops_per_token(trainable, layers, width, seq_len, frozen_params=frozen))
    else:
        out.update(flops_counted=FULL_COUNT, flops_per_token=flops_per_token(trainable, layers, width, seq_len))
    return out


def mfu(tokens_per_s: float | None, flops_per_tok: int | None, device_name: str | None, precision: str,
        n_devices: int, tf32_enabled: bool = False) -> float | None:
    """Achieved model FLOP/s over the devices' dense peak (0..1); None when anything is unknown."""
    peak = peak_tflops(device_name, precision, tf32_enabled)
    if peak is None or not tokens_per_s or not flops_per_tok or n_devices < 1:
        return None
    return tokens_per_s * flops_per_tok / (peak * 1e12 * n_devices)


def summary_fields(summary: dict[str, Any], model_info: dict[str, Any], device_name: str | None,
                   tf32_enabled: bool = False) -> dict[str, Any]:
    """The MFU keys of summary.json, from the summary's throughput and the model's FLOPs per token."""
    fpt = model_info.get("flops_per_token")
    precision = summary.get("precision", "fp32")
    n_dev = int(summary.get("world_size") or 1)
    entry = find_peak(device_name) if summary.get("device_type") == "cuda" else None
    name = device_name if summary.get("device_type") == "cuda" else None
    out: dict[str, Any] = {
        "flops_per_token": fpt,
        "flops_formula": ("4N_frozen + 6N_trainable + 12*L*H*Q*T (PaLM appendix B, no weight gradients for frozen "
                          "weights); N excludes embedding look-ups" if model_info.get("flops_counted") == ADAPTER_COUNT
                          else "6N + 12*L*H*Q*T (PaLM appendix B); N excludes embedding look-ups"),
        "flops_counted": model_info.get("flops_counted") or FULL_COUNT,
        "model_tflops_per_s": (summary["useful_tokens_per_s"] * fpt / 1e12) if fpt and summary.get("useful_tokens_per_s") else None,
        "device_name": name or summary.get("device_type"),
        "peak_tflops_per_device": peak_tflops(name, precision, tf32_enabled) if entry else None,
        "peak_math_mode": math_mode(precision, tf32_enabled),
        "mfu": mfu(summary.get("useful_tokens_per_s"), fpt, name, precision, n_dev, tf32_enabled),
        "mfu_all_tokens": mfu(summary.get("tokens_per_s"), fpt, name, precision, n_dev, tf32_enabled),
    }
    if out["mfu"] is None:
        why = "no dense peak is known for this device" if out["peak_tflops_per_device"] is None else "no throughput measured"
        out["mfu_note"] = f"MFU not reported: {why} ({out['device_name']}, {out['peak_math_mode']})"
    return out


__all__ = ["DevicePeak", "GPU_PEAKS", "find_peak", "math_mode", "peak_tflops", "matmul_params", "matmul_split", "attention_width",
           "flops_per_token", "FULL_COUNT", "ADAPTER_COUNT", "model_flops", "mfu", "summary_fields"]
