#!/usr/bin/env python3
"""Where FSDP2 loses time against a plain model on ONE GPU (issue 15, "sharding without the tax").

One process, one GPU, variants run one after another on the same GPT-2 (random init, SDPA, dropout as configured):
  dp            fp32 weights, bf16 autocast, fused AdamW over the plain parameters (shardlab's dp on one rank)
  fsdp-blocks   fully_shard per block + root, MixedPrecisionPolicy(bf16, fp32 reduce), reshard_after_forward=False
  fsdp-model    fully_shard on the root only (one FSDP unit)
  ...-foreach   the same with foreach AdamW instead of fused
  ...-local     DIAGNOSTIC: AdamW over the DTensors' local tensors (not a shardlab option; it measures DTensor dispatch)
  ...-copt      torch.compile(optimizer.step) (lr as a tensor)
Each step: forward, backward, optimizer.step, zero_grad(set_to_none), loss.item() (the one sync per step as shardlab).
Per phase: host time until the call returns (CPU launch cost) and device time between CUDA events.

    torchrun-free: python3 benchmarks/fsdp_one_rank.py --variants dp,fsdp-blocks,fsdp-model --micro 8 --out $OUT/x.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:  # noqa: C901 - a one-off GPU probe, kept as it was run
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="dp,fsdp-blocks,fsdp-model,fsdp-model-foreach,fsdp-model-local")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the variants")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (whole model)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, GPT2Config

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mesh = init_device_mesh("cuda", (1,))
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=max(1024, args.seq))

    def build():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().to(dev)
        m.config.use_cache = False
        m.train()
        return m

    def run(variant: str) -> dict:
        model = build()
        fsdp = variant.startswith("fsdp")
        if fsdp:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            kw = dict(mesh=mesh, reshard_after_forward=False, mp_policy=mp)
            if variant.startswith("fsdp-blocks"):
                for b in model.transformer.h:
                    fully_shard(b, **kw)
            fully_shard(model, **kw)
        params = list(model.parameters())
        units = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")] if fsdp else []
        prefetch = "-pf" in variant
        lr = 1e-4
        if variant.endswith("-local"):
            with torch.no_grad():
                opt_params = [p.to_local() for p in params]  # views of the shards; grads copied in below
            opt = torch.optim.AdamW(opt_params, lr=lr, fused=True)
        elif variant.endswith("-foreach"):
            opt = torch.optim.AdamW(params, lr=lr, foreach=True)
        elif variant.endswith("-copt"):
            opt = torch.optim.AdamW(params, lr=torch.tensor(lr), fused=True)
        else:
            opt = torch.optim.AdamW(params, lr=lr, fused=True)
        step_fn = opt.step
        if variant.endswith("-copt"):
            step_fn = torch.compile(opt.step)
        fwd_model = torch.compile(model) if args.compile else model
        ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if not fsdp else (lambda: torch.autocast("cuda", enabled=False))
        g = torch.Generator(device=dev).manual_seed(1)
        recs = []
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        for i in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), device=dev, generator=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ev[0].record()
            with ctx():
                loss = fwd_model(input_ids=x, labels=x).loss
            t1 = time.perf_counter()
            ev[1].record()
            loss.backward()
            t2 = time.perf_counter()
            ev[2].record()
            if variant.endswith("-local"):
                with torch.no_grad():
                    for lp, p in zip(opt_params, params):
                        lp.grad = p.grad.to_local()
            step_fn()
            opt.zero_grad(set_to_none=True)
            if variant.endswith("-local"):
                model.zero_grad(set_to_none=True)
            if prefetch:
                for u in units:
                    u.unshard()
            t3 = time.perf_counter()
            ev[3].record()
            loss_v = loss.item()
            t4 = time.perf_counter()
            if i >= args.warmup:
                recs.append(dict(wall=t4 - t0, cpu_fwd=t1 - t0, cpu_bwd=t2 - t1, cpu_opt=t3 - t2,
                                 gpu_fwd=ev[0].elapsed_time(ev[1]) / 1e3, gpu_bwd=ev[1].elapsed_time(ev[2]) / 1e3,
                                 gpu_opt=ev[2].elapsed_time(ev[3]) / 1e3, loss=loss_v))
        med = {k: statistics.median(r[k] for r in recs) for k in recs[0]}
        med["tok_s"] = args.micro * args.seq / med["wall"]
        med["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model, opt, fwd_model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return med

    rows = []
    for rnd in range(args.rounds):
        for v in args.variants.split(","):
            try:
                m = run(v)
            except Exception as e:  # noqa: BLE001 - a failed variant is reported, the others still run
                print(f"{v} FAILED: {type(e).__name__}: {e}", flush=True)
                continue
            m.update(variant=v, round=rnd, micro=args.micro, compile=args.compile)
            rows.append(m)
            print(f"{v:24s} r{rnd} {m['tok_s']:9,.0f} tok/s  wall {m['wall']*1e3:6.1f} ms | cpu fwd/bwd/opt "
                  f"{m['cpu_fwd']*1e3:6.1f} {m['cpu_bwd']*1e3:6.1f} {m['cpu_opt']*1e3:6.1f} | gpu fwd/bwd/opt "
                  f"{m['gpu_fwd']*1e3:6.1f} {m['gpu_bwd']*1e3:6.1f} {m['gpu_opt']*1e3:6.1f} | peak {m['peak_gib']:.2f} GiB "
                  f"loss {m['loss']:.4f}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(m) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
