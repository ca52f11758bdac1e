#!/usr/bin/env python3
"""Where does shardlab's dp step lose time against the bare PyTorch loop? (issue 2, H100 gap)

Two halves, both profiled with the same torch.profiler schedule (shardlab.measure.profiling.StepProfiler:
skip the warm-up, record 4 steps):

  bare     the eager bf16 loop of bare_reference.py (GPT2Config, SDPA, fused AdamW over
           model.parameters(), random tokens made on the GPU, labels = input_ids), optionally
           with one of shardlab's differences switched on, to measure each one alone:
             --groups      shardlab's two AdamW parameter groups (decay / no decay)
             --scheduler   a LambdaLR stepped every step
             --loader      batches from a DataLoader over CPU tensors, pinned, copied non-blocking,
                           separate labels tensor (what shardlab's data path does)
             --use-cache-off  pass use_cache=False to the forward
  compare  diff two profiles (ops_rank0.json) by operator: per-step self device time and calls

  python3 benchmarks/profile_dp.py bare --out $OUT/bare [--groups --scheduler --loader]
  python3 -m shardlab train ... --profile --output-dir RUN       # shardlab's side (RUN/profile)
  python3 benchmarks/profile_dp.py compare $OUT/bare RUN/profile
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def bare(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from shardlab.measure.profiling import StepProfiler

    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=max(1024, args.seq))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().to(dev)
    model.config.use_cache = False
    model.train()
    if args.groups:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        params = [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=dev.type == "cuda" or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if args.scheduler else None
    bf16 = args.precision == "bf16"

    total = args.warmup + args.steps
    if args.loader:
        data = torch.randint(0, cfg.vocab_size, (total * args.micro, args.seq))
        ds = torch.utils.data.TensorDataset(data)

        def collate(rows):
            ids = torch.stack([r[0] for r in rows])
            return {"input_ids": ids, "labels": ids.clone()}

        it = iter(torch.utils.data.DataLoader(ds, batch_size=args.micro, collate_fn=collate, pin_memory=dev.type == "cuda"))

        def batch():
            b = next(it)
            return {k: v.to(dev, non_blocking=True) for k, v in b.items()}
    else:
        def batch():
            x = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), device=dev)
            return {"input_ids": x, "labels": x}

    extra = {"use_cache": False} if args.use_cache_off else {}
    prof = StepProfiler(Path(args.out).parent, 0, dev, True, skip=args.warmup)
    prof.out = Path(args.out)  # the profiler writes here, not into <parent>/profile
    prof.out.mkdir(parents=True, exist_ok=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(total):
        b = batch()
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(**b, **extra).loss
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        prof.step(dt)
        if i >= args.warmup:
            times.append(dt)
        loss.item()
    prof.close()
    med = statistics.median(times)
    res = {"variant": args.label, "groups": args.groups, "scheduler": args.scheduler, "loader": args.loader,
           "use_cache_off": args.use_cache_off, "micro": args.micro, "seq": args.seq, "steps": args.steps,
           "step_ms_median": round(med * 1e3, 2), "step_ms_min": round(min(times) * 1e3, 2),
           "tokens_per_s": round(args.micro * args.seq / med, 1)}
    print(json.dumps(res), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(res) + "\n")


def compare(a_dir: str, b_dir: str, top: int) -> None:
    def load(d):
        ops = json.loads((Path(d) / "ops_rank0.json").read_text())
        steps = json.loads((Path(d) / "steps_rank0.json").read_text())
        n = steps["active_steps"]
        return {o["name"]: o for o in ops}, steps, n

    a, sa, na = load(a_dir)
    b, sb, nb = load(b_dir)
    print(f"A = {a_dir}: wall {sa['mean_step_wall_ms']:.2f} ms/step, device busy {sa.get('mean_device_busy_ms') or 0:.2f} ms/step")
    print(f"B = {b_dir}: wall {sb['mean_step_wall_ms']:.2f} ms/step, device busy {sb.get('mean_device_busy_ms') or 0:.2f} ms/step")
    rows = []
    for name in set(a) | set(b):
        oa, ob = a.get(name, {}), b.get(name, {})
        da = oa.get("self_device_us", 0) / na
        db = ob.get("self_device_us", 0) / nb
        ca = oa.get("self_cpu_us", 0) / na
        cb = ob.get("self_cpu_us", 0) / nb
        rows.append((db - da, name, da, db, oa.get("calls", 0) / na, ob.get("calls", 0) / nb, cb - ca))
    print(f"\nper step: operators whose self device time differs most (B - A), top {top}")
    print(f"{'delta us':>10} {'A us':>10} {'B us':>10} {'A calls':>8} {'B calls':>8} {'dCPU us':>9}  name")
    for d, name, da, db, ca, cb, dcpu in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        print(f"{d:10.1f} {da:10.1f} {db:10.1f} {ca:8.1f} {cb:8.1f} {dcpu:9.1f}  {name[:90]}")
    print("\nper step: operators whose call count differs (B - A)")
    for _, name, da, db, ca, cb, _ in sorted(rows, key=lambda r: -abs(r[5] - r[4]))[:top]:
        if ca != cb:
            print(f"{cb - ca:+8.1f} calls  {da:10.1f} -> {db:10.1f} us  {name[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bare")
    b.add_argument("--out", required=True)
    b.add_argument("--label", default="bare")
    b.add_argument("--results", default=None, help="append the timing record (JSON Lines)")
    b.add_argument("--device", default="cuda")
    b.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    b.add_argument("--layers", type=int, default=24)
    b.add_argument("--hidden", type=int, default=1024)
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--micro", type=int, default=8)
    b.add_argument("--seq", type=int, default=1024)
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--steps", type=int, default=30)
    for flag in ("--groups", "--scheduler", "--loader", "--use-cache-off"):
        b.add_argument(flag, action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    if args.cmd == "bare":
        bare(args)
    else:
        compare(args.a, args.b, args.top)


if __name__ == "__main__":
    sys.exit(main())
