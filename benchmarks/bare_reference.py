#!/usr/bin/env python3
"""Bare reference throughput/memory numbers that shardlab is compared against.

No shardlab code is used here: a plain Hugging Face GPT-2 (random init, SDPA attention) trained
either by a hand-written PyTorch loop or by a bare DeepSpeed engine, on random token ids.
This reproduces the reference table of shared/GPU.md (gpt2-medium, seq 1024, H100).

Modes (default micro batch in brackets):
  eager-fp32        plain PyTorch, fp32, no autocast                         [8]
  eager-bf16        plain PyTorch, bf16 autocast, eager                      [8]  (--micro 16, or "eager-bf16:16" in --modes)
  compile-bf16      plain PyTorch, bf16 autocast, torch.compile(model)       [16]
  eager-bf16-clip   eager-bf16 plus torch.nn.utils.clip_grad_norm_(1.0)      [8]
  ds-zero0..3       bare deepspeed.initialize(), bf16, AdamW from DS config  [8]
  ds-zero2-offload  ZeRO-2, optimizer offloaded to CPU (pinned)              [8]
  ds-zero3-offload  ZeRO-3, optimizer and params offloaded to CPU (pinned)   [8]

Each mode: --warmup steps, then --steps timed steps, a device synchronize around each step;
tokens/s = micro*seq/step_time; the median over timed steps is the headline number.
peak_alloc_gib = torch.cuda.max_memory_allocated() over the whole process (setup included).

  python3 benchmarks/bare_reference.py --mode eager-bf16 --out res.jsonl
  python3 benchmarks/bare_reference.py --all --out res.jsonl          # every mode, one fresh process each
  python3 benchmarks/bare_reference.py --all --device cpu --model-size tiny --seq 64 --micro 2 \
      --precision fp32 --warmup 1 --steps 2                           # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PLAIN_MODES = ["eager-fp32", "eager-bf16", "compile-bf16", "eager-bf16-clip"]
DS_MODES = ["ds-zero0", "ds-zero1", "ds-zero2", "ds-zero3", "ds-zero2-offload", "ds-zero3-offload"]
ALL_MODES = PLAIN_MODES + DS_MODES
DEFAULT_MICRO = {"eager-fp32": 8, "eager-bf16": 8, "compile-bf16": 16, "eager-bf16-clip": 8, **{m: 8 for m in DS_MODES}}
# The default --all list reproduces GPU.md's table row by row ("mode:micro" overrides the micro batch).
DEFAULT_ALL = ["eager-fp32", "eager-bf16", "eager-bf16:16", "compile-bf16"] + DS_MODES

MODEL_SIZES = {
    # name: (n_layer, n_embd, n_head)
    "tiny": (2, 64, 2),
    "gpt2": (12, 768, 12),  # 124M
    "medium": (24, 1024, 16),  # gpt2-medium, 355M
    "large": (36, 1280, 20),  # gpt2-large, 774M
}

# shared/GPU.md, H100 80GB, gpt2-medium, seq 1024: (mode, micro) -> (tokens/s, peak GiB)
GPU_MD_REFERENCE = {
    ("eager-fp32", 8): (17.0e3, 31.6),
    ("eager-bf16", 8): (56.0e3, 26.2),
    ("eager-bf16", 16): (60.4e3, 47.8),
    ("compile-bf16", 16): (136.9e3, 26.8),
    ("ds-zero0", 8): (53.3e3, 21.0),
    ("ds-zero1", 8): (45.2e3, 21.0),
    ("ds-zero2", 8): (44.5e3, 21.0),
    ("ds-zero3", 8): (19.9e3, 22.6),
    ("ds-zero2-offload", 8): (22.4e3, 17.1),
    ("ds-zero3-offload", 8): (15.6e3, 17.9),
}

# The multi-GPU machines must never use NVLink multicast (GPU.md); harmless elsewhere.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def log(*a):
    print("[bare_reference]", *a, file=sys.stderr, flush=True)


def sanitize_cuda_arch_list() -> None:
    """DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST with int() and dies on '9.0a'
    (ValueError: invalid literal for int() with base 10: '0a'). Strip arch-specific suffixes
    ('9.0a' -> '9.0', '10.0f' -> '10.0'), keep '+PTX'. Must run before deepspeed builds ops."""
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not raw:
        return
    out = []
    for tok in re.split(r"[;\s,]+", raw.strip()):
        if not tok:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)[A-Za-z]*(\+PTX)?", tok)
        if m:
            tok = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}"
        if tok not in out:
            out.append(tok)
    new = ";".join(out)
    if new != raw:
        log(f"TORCH_CUDA_ARCH_LIST {raw!r} -> {new!r} (DeepSpeed's op builder cannot parse arch suffixes)")
        os.environ["TORCH_CUDA_ARCH_LIST"] = new


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_dist_env(env: dict) -> dict:
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        env.setdefault(k, v)
    return env


def parse_mode_spec(spec: str) -> tuple[str, int | None]:
    mode, _, micro = spec.partition(":")
    if mode not in ALL_MODES:
        raise SystemExit(f"unknown mode {mode!r}; choose from {ALL_MODES}")
    return mode, (int(micro) if micro else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--mode", help=f"one of {ALL_MODES} (optionally 'mode:micro')")
    g.add_argument("--all", action="store_true", help="run --modes one after another, each in a fresh process")
    p.add_argument("--modes", default=",".join(DEFAULT_ALL), help="comma list for --all (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model-size", default="medium", choices=sorted(MODEL_SIZES))
    p.add_argument("--micro", type=int, default=None, help="micro batch (default: per mode, see above)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="override the mode's precision (bf16 except eager-fp32); fp32 for ds-* on CPU")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (off by default, as in the reference)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: torch's default)")
    p.add_argument("--vocab", type=int, default=None, help="vocab_size (default GPT-2's 50257; 50304 = padded to 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append one JSON object per mode (JSON Lines) to this file")
    p.add_argument("--timeout", type=int, default=1800, help="--all: seconds allowed per mode")
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)  # --all parent <-> child
    return p


# --------------------------------------------------------------------------------------------
# one mode, in this process
# --------------------------------------------------------------------------------------------
def run_mode(args) -> dict:  # noqa: C901 - a reference script: each mode's set-up inline, read beside the run it reproduces
    mode, spec_micro = parse_mode_spec(args.mode)
    micro = args.micro or spec_micro or DEFAULT_MICRO[mode]
    is_ds = mode.startswith("ds-")
    precision = args.precision or ("fp32" if mode == "eager-fp32" else "bf16")
    bf16 = precision == "bf16"
    dev = args.device

    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    if is_ds:
        sanitize_cuda_arch_list()
        single_process_dist_env(os.environ)
        if dev == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")

    t_start = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GPT2Config

    if dev == "cuda":
        assert torch.cuda.is_available(), "no CUDA device (use --device cpu for a smoke test)"
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    torch.manual_seed(args.seed)
    device = torch.device(dev)

    n_layer, n_embd, n_head = MODEL_SIZES[args.model_size]
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=max(1024, args.seq),
                     **({"vocab_size": args.vocab} if args.vocab else {}))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = model.float()  # fp32 master weights; autocast / DeepSpeed bf16 handle the rest
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    attn_impl = getattr(model.config, "_attn_implementation", None)
    vocab = cfg.vocab_size

    ds_version = None
    init_s = None
    if is_ds:
        import logging

        import deepspeed

        ds_version = deepspeed.__version__
        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="nccl" if dev == "cuda" else "gloo")
        stage = int(mode[len("ds-zero")])
        pin = dev == "cuda"
        zero = {"stage": stage}
        if mode.endswith("-offload"):
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        ds_config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        t0 = time.perf_counter()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        init_s = time.perf_counter() - t0  # includes JIT builds of FusedAdam / CPU Adam on first use
        log(f"deepspeed.initialize took {init_s:.1f}s; optimizer {type(engine.optimizer).__name__}")

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss
    else:
        model.to(device)
        model.train()
        fused = dev == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused or None)
        fwd = model
        clip = mode.endswith("-clip")
        if mode == "compile-bf16":
            fwd = torch.compile(model, **({"mode": args.compile_mode} if args.compile_mode else {}))

        def step(x):
            with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=bf16):
                loss = fwd(input_ids=x, labels=x).loss
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    setup_s = time.perf_counter() - t_start
    times, losses = [], []
    t_warm = time.perf_counter()
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, vocab, (micro, args.seq), device=device)
        sync()
        t0 = time.perf_counter()
        loss = step(x)
        sync()
        dt = time.perf_counter() - t0
        if i == args.warmup - 1 or (args.warmup == 0 and i == 0):
            warmup_s = time.perf_counter() - t_warm
        if i >= args.warmup:
            times.append(dt)
        losses.append(float(loss.detach().float().item()))
    if args.warmup == 0:
        warmup_s = 0.0

    tok = micro * args.seq
    tps = [tok / t for t in times]
    med_t = statistics.median(times)
    # approximate model FLOPs: 6*N per token + attention scores/values 12*L*d*s per token
    flops_per_tok = 6 * n_params + 12 * n_layer * n_embd * args.seq
    res = {
        "mode": mode,
        "model": {"medium": "gpt2-medium", "gpt2": "gpt2", "large": "gpt2-large"}.get(args.model_size, args.model_size),
        "micro": micro,
        "seq": args.seq,
        "vocab": vocab,
        "precision": precision,
        "tokens_per_s_median": round(statistics.median(tps), 1),
        "tokens_per_s_min": round(min(tps), 1),
        "tokens_per_s_max": round(max(tps), 1),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev == "cuda" else None,
        "steps": args.steps,
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "device_name": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        # extras
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if dev == "cuda" else None,
        "peak_rss_gib": round(_peak_rss_bytes() / 2**30, 2),
        "step_ms_median": round(med_t * 1e3, 2),
        "model_tflops_per_s": round(flops_per_tok * tok / med_t / 1e12, 2),
        "warmup": args.warmup,
        "setup_s": round(setup_s, 1),
        "ds_init_s": round(init_s, 1) if init_s is not None else None,
        "warmup_s": round(warmup_s, 1),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "params_m": round(n_params / 1e6, 1),
        "attn_implementation": attn_impl,
        "tf32": bool(args.tf32),
        "transformers": transformers.__version__,
        "device": dev,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if is_ds:
        import deepspeed

        res["ds_optimizer"] = type(engine.optimizer).__name__
        try:
            deepspeed.comm.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return res


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def emit(res: dict, out: str | None) -> None:
    line = json.dumps(res)
    print(line, flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")


# --------------------------------------------------------------------------------------------
# --all: one fresh process per mode
# --------------------------------------------------------------------------------------------
def child_argv(args, spec: str, result_file: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--mode", spec, "--device", args.device,
            "--model-size", args.model_size, "--seq", str(args.seq), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
            "--result-file", result_file]
    if args.micro and ":" not in spec:
        argv += ["--micro", str(args.micro)]
    for flag in ("precision", "compile_mode", "vocab"):
        if getattr(args, flag):
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.tf32:
        argv.append("--tf32")
    return argv


def run_all(args) -> int:
    specs = [s.strip() for s in args.modes.split(",") if s.strip()]
    for s in specs:
        parse_mode_spec(s)
    results, failed = [], 0
    for spec in specs:
        mode, spec_micro = parse_mode_spec(spec)
        env = dict(os.environ)
        env.update({k: env.get(k, v) for k, v in NO_MULTICAST_ENV.items()})
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        single_process_dist_env(env)  # fresh port per child: no TIME_WAIT clashes
        fd, rf = tempfile.mkstemp(prefix="bare_ref_", suffix=".json")
        os.close(fd)
        argv = child_argv(args, spec, rf)
        log(f"=== {spec}: {' '.join(argv[1:])}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, env=env, timeout=args.timeout, stdout=sys.stderr)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        res = None
        if os.path.getsize(rf) > 0:
            with open(rf) as f:
                res = json.load(f)
        os.unlink(rf)
        if res is None or rc != 0:
            failed += 1
            res = {"mode": mode, "micro": args.micro or spec_micro or DEFAULT_MICRO[mode], "error": f"rc={rc}",
                   "device": args.device, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **(res or {})}
        res["wall_s"] = round(wall, 1)
        emit(res, args.out)
        results.append(res)
    print_summary(results, args)
    return 1 if failed else 0


def print_summary(results, args) -> None:
    ref = args.device == "cuda" and args.model_size == "medium" and args.seq == 1024
    hdr = "| mode | micro | prec | tok/s median | peak GiB |" + (" GPU.md tok/s | GPU.md GiB |" if ref else "")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r.get('micro')} | - | FAILED ({r['error']}) | - |" + (" | |" if ref else ""))
            continue
        row = f"| {r['mode']} | {r['micro']} | {r['precision']} | {r['tokens_per_s_median']/1e3:.1f}k | {r['peak_alloc_gib']} |"
        if ref:
            t, g = GPU_MD_REFERENCE.get((r["mode"], r["micro"]), (None, None))
            row += f" {t/1e3:.1f}k | {g} |" if t else " | |"
        lines.append(row)
    print("\n".join(lines), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.all:
        return run_all(args)
    res = run_mode(args)
    emit(res, args.out)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
