"""Forward+backward time of F.scaled_dot_product_attention per backend on this GPU (issue 15: which kernel
``--set sdpa_backend`` should pick). Shapes of the speed cells: gpt2-medium micro 16 (16 heads of 64, seq 1024,
causal) and gpt2 / gpt2-large heads; bloom-560m micro 8 with an additive ALiBi-shaped bias (flash refuses a bias).

    python3 benchmarks/sdpa_probe.py [--out probe.json]

Prints one line per (shape, backend): median ms of fwd+bwd over 20 timed repeats after 5 warm-up ones, or why the
backend refused the inputs; and the largest difference of its output from the math backend's (fp32 reference).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name -> (batch, heads, seq, head_dim, causal, bias)
    "gpt2-medium m16": (16, 16, 1024, 64, True, False),
    "gpt2 m16": (16, 12, 1024, 64, True, False),
    "gpt2-large m8": (8, 20, 1024, 64, True, False),
    "bloom-560m m8 (bias)": (8, 16, 1024, 64, False, True),
}
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def run(shape, backend, reps=20, warm=5):
    b, h, s, d, causal, bias = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in range(3))
    mask = None
    if bias:  # ALiBi-like additive bias plus the causal mask, as compat/bloom_sdpa.py builds it
        slopes = torch.linspace(0.5, 0.004, h, device="cuda")
        pos = torch.arange(s, device="cuda")
        rel = (pos[None, :] - pos[:, None]).float()
        m = slopes[:, None, None] * rel[None]
        m = m.masked_fill(rel[None] > 0, float("-inf"))
        mask = m[None].to(torch.bfloat16).expand(b, h, s, s)
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        out.backward(grad)
        times = []
        for i in range(warm + reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            out.backward(grad)
            end.record()
            torch.cuda.synchronize()
            if i >= warm:
                times.append(start.elapsed_time(end))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=None if mask is None else mask.float(),
                                             is_causal=causal)
    return statistics.median(times), float((out.float() - ref).abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    rows = []
    for name, shape in SHAPES.items():
        for backend in BACKENDS:
            try:
                ms, err = run(shape, backend)
                rows.append({"shape": name, "backend": backend.name, "ms": ms, "max_abs_err": err})
                print(f"{name:24s} {backend.name:20s} {ms:8.3f} ms fwd+bwd  max|err| {err:.2e}", flush=True)
            except RuntimeError as e:
                rows.append({"shape": name, "backend": backend.name, "error": str(e).splitlines()[0][:200]})
                print(f"{name:24s} {backend.name:20s} refused: {str(e).splitlines()[0][:120]}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
