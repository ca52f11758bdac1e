"""Does DeepSpeed's ZeRO-3 linear (LinearFunctionForZeroStage3, what zero_optimization.memory_efficient_linear puts in
place of torch.nn.functional.linear) give eager's gradients under torch.compile? A small MLP block of linears, with and
without biases, called as DeepSpeed calls it (the function directly, and nn.Linear after F.linear is replaced), eager
against inductor, on the device given. Prints each gradient's relative error against eager's.

    python benchmarks/diag/zero3_linear_compile.py [cuda|cpu] [bf16|fp32]
"""

import sys

import torch
import torch.nn.functional as F
from deepspeed.runtime.zero.linear import zero3_linear_wrap

DEVICE = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[2] if len(sys.argv) > 2 else "bf16"]


class Block(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.norm = torch.nn.LayerNorm(512)
        self.up = torch.nn.Linear(512, 2048, bias=bias)
        self.down = torch.nn.Linear(2048, 512, bias=bias)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def grads(bias: bool, compiled: bool, patched: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(bias), Block(bias)).to(DEVICE, DTYPE)
    x = torch.randn(4, 128, 512, device=DEVICE, dtype=DTYPE, requires_grad=True)
    original = F.linear
    if patched:
        torch.nn.functional.linear = zero3_linear_wrap  # what zero.Init does (partition_parameters.py)
    try:
        torch._dynamo.reset()
        fn = torch.compile(model) if compiled else model
        fn(x).float().square().mean().backward()
    finally:
        torch.nn.functional.linear = original
    return {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


def main():
    print(f"torch {torch.__version__} on {DEVICE}, {DTYPE}")
    for bias in (False, True):
        for patched in (False, True):
            eager, compiled = grads(bias, False, patched), grads(bias, True, patched)
            worst = max(((compiled[n] - g).float().norm() / g.float().norm()).item() for n, g in eager.items())
            missing = [n for n, g in compiled.items() if g is None]
            print(f"bias={bias!s:5} ZeRO-3 linear={patched!s:5}  worst relative error {worst:.2e}"
                  f"  grad norms eager/compiled: "
                  + ", ".join(f"{n} {eager[n].float().norm():.3g}/{compiled[n].float().norm():.3g}"
                              for n in ("x", "0.up.weight", "0.up.bias") if n in eager)
                  + (f"  missing {missing}" if missing else ""))


if __name__ == "__main__":
    main()
