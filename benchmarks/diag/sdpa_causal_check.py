"""GPU check of training/sdpa_causal.py on the machine's transformers: is gpt2-medium switched to shardlab_sdpa, does
SDPA get a mask under torch.compile, and what does its attention kernel cost per layer, eager vs compiled (micro 16)."""

import torch
from torch.profiler import ProfilerActivity, profile

import transformers
from shardlab.config import RunConfig
from shardlab.training import sdpa_causal
from shardlab.training.models import build_model

print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
seen = []
orig = torch.nn.functional.scaled_dot_product_attention


def spy(*a, **k):
    seen.append((k.get("attn_mask") is not None or (len(a) > 3 and a[3] is not None), k.get("is_causal")))
    return orig(*a, **k)


torch.nn.functional.scaled_dot_product_attention = spy
for impl in ("shardlab", "sdpa"):
    model = build_model(RunConfig(model="gpt2-medium", seq_len=1024)).cuda()
    if impl == "sdpa":
        model.set_attn_implementation("sdpa")
    print(impl, "->", model.config._attn_implementation, "registered:", bool(sdpa_causal._registered), flush=True)
    ids = torch.randint(0, 50257, (16, 1024), device="cuda")
    for mode in ("eager", "compiled"):
        fn = model if mode == "eager" else torch.compile(model)
        seen.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(2):
                fn(ids).logits.float().mean().backward()
        masks = sorted(set(seen))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                fn(ids).logits.float().mean().backward()
            torch.cuda.synchronize()
        att = [(e.key[:60], e.device_time_total / max(1, e.count)) for e in prof.key_averages()
               if "sdpa" in e.key or "attention" in e.key.lower() or "fmha" in e.key]
        print(f"  {mode:8s} sdpa calls seen (mask?, is_causal): {masks}", flush=True)
        for k, us in att:
            print(f"    {us:9.1f} us/call  {k}", flush=True)
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
