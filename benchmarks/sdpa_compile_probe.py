"""Why gpt2-medium's attention costs 2.3x more per sequence under torch.compile than in eager mode (issue 15;
benchmarks/results/2026-11-26-h100-attention, call 3): F.scaled_dot_product_attention fwd+bwd at micro 16, eager against
torch.compile, with and without dropout, with q/k/v made as HF's GPT-2 makes them (a (B, S, H, D) view transposed) and
contiguous. Prints median ms over 20 repeats and the cuDNN/flash kernel names the profiler saw.

    python3 benchmarks/sdpa_compile_probe.py
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

B, H, S, D = 16, 16, 1024, 64


def attn(x, w, p):
    qkv = (x @ w).view(B, S, 3, H, D)  # as GPT2Attention: one projection, heads split, then (B, H, S, D) views
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def timed(fn, x, w, p):
    for _ in range(3):
        fn(x, w, p).sum().backward()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x, w, p).sum().backward()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, w, p).sum().backward()
        torch.cuda.synchronize()
    kernels = sorted({e.key[:70] for e in prof.key_averages() if "sdpa" in e.key or "flash" in e.key or "fmha" in e.key})
    return statistics.median(times), kernels


def main():
    torch.manual_seed(0)
    x = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(H * D, 3 * H * D, device="cuda", dtype=torch.bfloat16) / 32
    compiled = torch.compile(attn)
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    for name, fn in (("eager", attn), ("compiled", compiled)):
        for p in (0.0, 0.1):
            ms, kernels = timed(fn, x, w, p)
            print(f"{name:9s} dropout {p:.1f}: {ms:7.3f} ms fwd+bwd (incl. the qkv matmul)  {kernels}", flush=True)


if __name__ == "__main__":
    main()
