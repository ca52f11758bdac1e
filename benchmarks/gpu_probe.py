"""What the GPU image can run of the optional libraries (torchao, bitsandbytes, liger-kernel): imports and one step each."""
import time, torch, importlib
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for m in ["transformers", "deepspeed", "torchao", "bitsandbytes", "liger_kernel", "gguf"]:
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "IMPORT FAILED", type(e).__name__, str(e)[:200])
dev = "cuda"
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).to(dev)
x = torch.randn(64, 4096, device=dev)
def try_opt(name, make):
    try:
        opt = make()
        for _ in range(3):
            t = time.perf_counter(); model(x).square().mean().backward(); opt.step(); opt.zero_grad(); torch.cuda.synchronize()
        print(name, "OK", f"{(time.perf_counter()-t)*1e3:.1f} ms/step")
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:300])
try_opt("torchao AdamW8bit", lambda: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit(model.parameters()))
try_opt("torchao CPUOffloadOptimizer", lambda: __import__("torchao.optim", fromlist=["CPUOffloadOptimizer"]).CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True))
try_opt("bnb AdamW8bit", lambda: __import__("bitsandbytes").optim.AdamW8bit(model.parameters()))
try:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    lf = LigerFusedLinearCrossEntropyLoss()
    w = torch.randn(50257, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 50257, (2048,), device=dev)
    l = lf(w, h, y); l.backward(); print("liger FLCE OK", float(l))
except Exception as e:
    print("liger FLCE FAILED", type(e).__name__, str(e)[:300])
# FlexAttention with an ALiBi score_mod, compiled
try:
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    B, H, S, D = 8, 16, 1024, 64
    q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(H, device=dev)
    def alibi(score, b, h, qi, ki): return score + slopes[h] * (ki - qi)
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=dev)
    fa = torch.compile(flex_attention)
    out = fa(q, k, v, score_mod=alibi, block_mask=bm); out.sum().backward(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        out = fa(q, k, v, score_mod=alibi, block_mask=bm); out.sum().backward()
    torch.cuda.synchronize(); print("flex alibi OK", f"{(time.perf_counter()-t)*100:.2f} ms/iter")
except Exception as e:
    print("flex alibi FAILED", type(e).__name__, str(e)[:300])
