#!/usr/bin/env python3
"""shardlab against its peers, in one run on one GPU: same model, data, batch, sequence length and precision.

Peers (each a fresh process):
  hf-padded     the seeds' stack: HF `Trainer` + a DeepSpeed ZeRO JSON (HF's documented ZeRO-2/3 config with
                "auto" values), on WikiText-style lines tokenized one line per sample with
                padding="max_length" and DataCollatorForLanguageModeling, as the tutorials prepare them
  hf-packed     the same Trainer + DeepSpeed on the same text packed into full blocks (the engine alone)
  bare-eager    benchmarks/bare_reference.py: a hand-written PyTorch loop, bf16 autocast, eager
  bare-compile  the same loop with torch.compile (with --compile)
shardlab cells (one `shardlab bench` over a generated suite, same text):
  STRATEGY         packed blocks, gradient clipping 1.0 as HF's default       vs hf-padded (target >= 3x), hf-packed
  STRATEGY-padded  one padded line per sample, as the tutorials               vs hf-padded (engines at equal data)
  dp-noclip        no clipping, as the bare loop                               vs bare-eager (target >= 1.0x)
  dp-compile-noclip  --compile, no clipping                                    vs bare-compile (with --compile)

Throughput everywhere: the median step time after the first 3 steps (warm-up), useful tokens = non-pad tokens;
HF's steps are timed by a TrainerCallback (CUDA synchronised at each step end, as shardlab's timer does) and its
non-pad tokens counted in the data collator on the CPU (no extra GPU sync; the i-th batch collated is the i-th trained). Results: peers.json, peers.md (ratios) and the bench directory.

GPU machine (offline; `.whl` carried, see benchmarks/README_bare_reference.md), one command:
    bash benchmarks/peers.sh gpt2-medium zero2 40            # ~7 min on an H100 (add --compile: ~10 min)
CPU smoke test of the HF Trainer path (tests/test_peers.py):
    python benchmarks/peers.py --device cpu --model tiny-gpt2 --seq 64 --micro 2 --steps 6 --peers hf-padded --no-shardlab
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 3  # steps excluded from timing, as shardlab's metrics.WARMUP_STEPS
BARE_SIZE = {"gpt2": "gpt2", "gpt2-medium": "medium", "gpt2-large": "large"}

# HF's documented DeepSpeed config (docs "DeepSpeed integration", ZeRO-2 / ZeRO-3 examples), "auto" filled by the Trainer.
HF_DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}
HF_ZERO = {
    2: {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True,
        "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    3: {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


def log(*a) -> None:
    print("[peers]", *a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# data: WikiText-style lines (one paragraph per line, " = Heading = " lines, blank lines between)


def wikitext_style_lines() -> list[str]:
    """WikiText-2-raw's layout, written from the offline corpus (CPython's pydoc topics): the GPU machine has no hub."""
    from pydoc_data.topics import topics

    lines: list[str] = []
    for key in sorted(topics):
        lines += [f" = {key} = ", ""]
        for para in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(para.split())
            if text:
                lines += [f" {text} ", ""]
    return lines


def write_text(path: Path, source: str | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if source:
        path.write_text(Path(source).read_text(encoding="utf-8"))
    else:
        path.write_text("\n".join(wikitext_style_lines()) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# (a) HF Trainer + DeepSpeed, in this (child) process


def _single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)


def hf_worker(args) -> dict:
    """Train with transformers.Trainer as the tutorials do; return the timing record."""
    _single_process_env()
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(HERE.parent / "src"))
    import torch
    from datasets import load_dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    from shardlab.config import RunConfig
    from shardlab.training.models import build_model
    from shardlab.training.tokenizing import load_tokenizer

    cfg = RunConfig(model=args.model, seq_len=args.seq, device=args.device, seed=args.seed)
    tok = load_tokenizer(cfg)
    model = build_model(cfg)  # the same random-init preset shardlab trains (a tutorial would call from_pretrained)
    raw = load_dataset("text", data_files={"train": str(args.text)})["train"]
    if args.data == "padded":
        def encode(batch):
            return tok(batch["text"], padding="max_length", truncation=True, max_length=args.seq)

        ds = raw.map(encode, batched=True, remove_columns=["text"])
    else:  # packed: the same text as one token stream cut into full blocks (HF's run_clm group_texts)
        def encode(batch):
            return tok(batch["text"])

        def group(batch):
            ids = [t for seq in batch["input_ids"] for t in seq]
            n = len(ids) // args.seq * args.seq
            blocks = [ids[i : i + args.seq] for i in range(0, n, args.seq)]
            return {"input_ids": blocks, "attention_mask": [[1] * args.seq for _ in blocks]}

        ds = raw.map(encode, batched=True, remove_columns=["text"]).map(group, batched=True, remove_columns=["attention_mask"])

    useful: list[int] = []
    base_collator = DataCollatorForLanguageModeling(tok, mlm=False)

    def collator(features):
        # Counted on the CPU (no GPU sync): batches are consumed in the order they are collated (checked on CPU)
        batch = base_collator(features)
        useful.append(int(batch["attention_mask"].sum()))
        return batch

    step_ends: list[float] = []
    cuda = args.device == "cuda"

    class StepClock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

        def on_train_begin(self, *_a, **_k):
            step_ends.append(time.perf_counter())

    bf16 = args.precision == "bf16"
    ds_config = None
    if args.hf_stage is not None:
        ds_config = {**HF_DS_CONFIG, "zero_optimization": HF_ZERO[args.hf_stage]}
    targs = TrainingArguments(
        output_dir=str(args.out / f"hf-{args.data}"), per_device_train_batch_size=args.micro, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=1e-4, bf16=bf16, deepspeed=ds_config, logging_steps=10**6, save_strategy="no",
        # transformers 5.17 fills the JSON's "auto" warmup_num_steps with 0, which DeepSpeed 0.19's WarmupLR refuses.
        warmup_steps=1,
        report_to="none", use_cpu=not cuda, seed=args.seed, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=ds, data_collator=collator, callbacks=[StepClock()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    dts = [b - a for a, b in zip(step_ends, step_ends[1:])]
    timed = dts[WARMUP:] if len(dts) > WARMUP else dts
    per_step = useful[: len(dts)]  # gradient accumulation 1: the i-th collated batch is the i-th step's
    useful_timed = per_step[WARMUP : WARMUP + len(timed)] if len(dts) > WARMUP else per_step
    med = statistics.median(timed)
    tokens_per_step = args.micro * args.seq
    return {
        "peer": f"hf-{args.data}", "engine": f"transformers.Trainer + DeepSpeed ZeRO-{args.hf_stage}" if ds_config else "transformers.Trainer",
        "model": args.model, "micro": args.micro, "seq": args.seq, "precision": args.precision, "steps": len(dts),
        "timed_steps": len(timed), "step_time_median_s": med, "tokens_per_s": tokens_per_step / med,
        "useful_tokens_per_s": statistics.fmean(useful_timed) / med if useful_timed else None,
        "non_pad_fraction": sum(per_step) / (tokens_per_step * len(per_step)) if per_step else None,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "wall_s": wall,
        "train_rows": len(ds),
    }


# --------------------------------------------------------------------------------------------------
# the parent: every peer in its own process, then shardlab via bench


def run_child(argv: list[str], timeout: float, log_path: Path) -> int | str:
    log(" ".join(argv))
    with open(log_path, "w") as f:
        try:
            return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def run_hf(args, data: str) -> dict:
    result = args.out / f"hf-{data}.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, __file__, "--hf-worker", "--data", data, "--result", str(result), "--text", str(args.text),
            "--model", args.model, "--seq", str(args.seq), "--micro", str(args.micro), "--steps", str(args.steps),
            "--precision", args.precision, "--device", args.device, "--out", str(args.out), "--seed", str(args.seed)]
    if args.hf_stage is not None:
        argv += ["--hf-stage", str(args.hf_stage)]
    rc = run_child(argv, args.timeout, args.out / f"hf-{data}.log")
    if rc == 0 and result.is_file():
        return json.loads(result.read_text())
    return {"peer": f"hf-{data}", "error": f"exit {rc}", "log": f"hf-{data}.log"}


def run_bare(args, modes: list[str]) -> list[dict]:
    out = args.out / "bare.jsonl"
    out.unlink(missing_ok=True)
    size = BARE_SIZE.get(args.model)
    if size is None:
        return [{"peer": f"bare-{m}", "error": f"bare_reference.py has no {args.model} (gpt2, gpt2-medium, gpt2-large)"} for m in modes]
    if args.precision != "bf16" and "compile" in modes:  # bare_reference.py compiles in bf16 only
        modes = [m for m in modes if m != "compile"]
    specs = ",".join(f"{m}-{args.precision}:{args.micro}" for m in modes)
    argv = [sys.executable, str(HERE / "bare_reference.py"), "--all", "--modes", specs, "--model-size", size, "--seq", str(args.seq),
            "--warmup", str(WARMUP + 2), "--steps", str(args.steps - WARMUP - 2), "--device", args.device, "--out", str(out)]
    run_child(argv, args.timeout * len(modes), args.out / "bare.log")
    rows = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.is_file() else []
    res = []
    for m in modes:
        rec = next((r for r in rows if r.get("mode") == f"{m}-{args.precision}"), None)
        if rec is None or "error" in rec:
            res.append({"peer": f"bare-{m}", "error": (rec or {}).get("error", "no result"), "log": "bare.log"})
        else:
            res.append({"peer": f"bare-{m}", "engine": f"hand-written PyTorch loop ({m})", "micro": rec["micro"], "seq": rec["seq"],
                        "precision": rec["precision"], "tokens_per_s": rec["tokens_per_s_median"],
                        "useful_tokens_per_s": rec["tokens_per_s_median"], "peak_alloc_gib": rec.get("peak_alloc_gib"),
                        "timed_steps": rec.get("steps")})
    return res


def shardlab_suite(args) -> dict:
    base = {"model": args.model, "dataset": {"source": str(args.text)}, "seq_len": args.seq, "precision": args.precision,
            "micro_batch": args.micro, "grad_accum": 1, "gpus": 1, "max_steps": args.steps, "lr": 1.0e-4, "log_every": 10,
            "export": False, "device": args.device, "seed": args.seed}
    cells = [{"label": args.strategy, "set": {"strategy": args.strategy}},
             {"label": f"{args.strategy}-padded", "set": {"strategy": args.strategy, "dataset": {"source": str(args.text), "packing": "pad"}}},
             {"label": "dp-noclip", "set": {"strategy": "dp", "max_grad_norm": None}}]
    if args.compile:
        cells.append({"label": "dp-compile-noclip", "set": {"strategy": "dp", "compile": True, "max_grad_norm": None}})
    return {"description": "shardlab cells of benchmarks/peers.py", "base": base,
            "parts": [{"name": "strategies", "compare": "strategy", "equal": ["precision", "global_batch", "seq_len", "tokens"], "cells": cells}]}


def run_shardlab(args) -> list[dict]:
    import yaml

    suite = args.out / "peers-suite.yaml"
    suite.write_text(yaml.safe_dump(shardlab_suite(args), sort_keys=False))
    bench_dir = Path(args.bench_dir)
    argv = [sys.executable, "-m", "shardlab", "bench", "--suite", str(suite), "--output-dir", str(bench_dir), "--cell-timeout", str(args.timeout)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")])))
    log(" ".join(argv))
    with open(args.out / "shardlab-bench.log", "w") as f:
        subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout * 5)
    if not (bench_dir / "bench.json").is_file():
        return [{"peer": "shardlab", "error": "shardlab bench did not start (see shardlab-bench.log)"}]
    state = json.loads((bench_dir / "bench.json").read_text())
    out = []
    for cell in state["cells"]:
        rec = next((r for r in cell["repeats"] if r["status"] == "ok"), None)
        if rec is None:
            reason = next((r.get("reason") for r in cell["repeats"] if r.get("reason")), "failed")
            out.append({"peer": f"shardlab {cell['label']}", "error": reason})
            continue
        s = json.loads((bench_dir / rec["run_dir"] / "summary.json").read_text())
        out.append({"peer": f"shardlab {cell['label']}", "engine": f"shardlab {s['strategy']}", "micro": s["micro_batch"], "seq": s["seq_len"],
                    "precision": s["precision"], "tokens_per_s": s["tokens_per_s"], "useful_tokens_per_s": s["useful_tokens_per_s"],
                    "non_pad_fraction": s.get("non_pad_fraction"), "peak_alloc_gib": s.get("gpu_mem_peak_gib"),
                    "timed_steps": s.get("timed_steps"), "mfu": s.get("mfu"), "run_dir": str(bench_dir / rec["run_dir"])})
    return out


def ratios(rows: list[dict], strategy: str) -> list[dict]:
    by = {r["peer"]: r for r in rows}
    pairs = [
        (f"shardlab {strategy}", "hf-padded", "packed vs the tutorials' padded lines (the issue's target)", 3.0),
        (f"shardlab {strategy}", "hf-packed", "both packed: the engines alone", None),
        (f"shardlab {strategy}-padded", "hf-padded", "both on padded lines: the engines alone", None),
        ("shardlab dp-noclip", "bare-eager", "vs the bare loop, eager, no clipping on either side", 1.0),
        ("shardlab dp-compile-noclip", "bare-compile", "vs the bare loop, torch.compile, no clipping", 1.0),
    ]
    out = []
    for mine, peer, what, target in pairs:
        a, b = by.get(mine), by.get(peer)
        if not a or not b:
            continue
        r = a["useful_tokens_per_s"] / b["useful_tokens_per_s"] if a.get("useful_tokens_per_s") and b.get("useful_tokens_per_s") else None
        out.append({"shardlab": mine, "peer": peer, "what": what, "shardlab_useful_tok_s": a.get("useful_tokens_per_s"),
                    "peer_useful_tok_s": b.get("useful_tokens_per_s"), "ratio": r, "target": target,
                    "met": None if r is None or target is None else r >= target})
    return out


def markdown(rows: list[dict], rat: list[dict], args, device: str) -> str:
    lines = [f"# shardlab vs peers: {args.model}, seq {args.seq}, micro {args.micro}, {args.precision}, {args.steps} steps, {device}", "",
             "| run | engine | useful tok/s | all tok/s | non-pad | peak GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['peer']} | FAILED: {r['error']} | | | | |")
            continue
        npf = r.get("non_pad_fraction")
        npf_text = "" if npf is None else f"{npf:.1%}"
        peak = "" if r.get("peak_alloc_gib") is None else f"{r['peak_alloc_gib']:.1f}"
        lines.append(f"| {r['peer']} | {r.get('engine', '')} | {r['useful_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {npf_text} | {peak} |")
    lines += ["", "| shardlab | peer | what | ratio (useful tok/s) | target |", "|---|---|---|---|---|"]
    for x in rat:
        goal = "" if x["target"] is None else f">= {x['target']:g}x " + ("met" if x["met"] else "NOT met")
        ratio_text = "" if x["ratio"] is None else f"{x['ratio']:.2f}x"
        lines.append(f"| {x['shardlab']} | {x['peer']} | {x['what']} | {ratio_text} | {goal} |")
    lines += ["", f"Timing: median step time after {WARMUP} warm-up steps; useful tokens = non-pad tokens. Same model (shardlab's "
              f"{args.model} preset, random init), same text ({args.text.name}), micro {args.micro}, seq {args.seq}, {args.precision}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--strategy", default="zero2", help="shardlab strategy compared with HF Trainer + DeepSpeed")
    p.add_argument("--hf-stage", type=int, default=None, help="DeepSpeed ZeRO stage of the HF peer (default: the strategy's; "
                                                              "-1 = no DeepSpeed)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--peers", default="hf-padded,hf-packed,bare-eager", help="comma list of hf-padded, hf-packed, bare-eager, bare-compile")
    p.add_argument("--compile", action="store_true", help="also bare-compile and shardlab dp --compile (~3 more minutes on an H100)")
    p.add_argument("--no-shardlab", action="store_true", help="only the peers (CPU smoke test)")
    p.add_argument("--text", type=Path, default=None, help="a text file instead of the WikiText-style offline lines")
    p.add_argument("--out", type=Path, default=Path("runs/peers"))
    p.add_argument("--bench-dir", default=None, help="where shardlab's runs go (default: OUT/bench)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default="padded", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.hf_stage is None and args.strategy.startswith("zero"):
        args.hf_stage = int(args.strategy[4])
    if args.hf_stage == -1:
        args.hf_stage = None
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hf_worker:
        res = hf_worker(args)
        Path(args.result).write_text(json.dumps(res))
        print(json.dumps(res), flush=True)
        return 0
    args.text = write_text(args.out / "wikitext_style.txt", str(args.text) if args.text else None).resolve()
    args.bench_dir = args.bench_dir or str(args.out / "bench")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if args.compile and "bare-compile" not in peers:
        peers.append("bare-compile")
    rows: list[dict] = []
    for data in ("padded", "packed"):
        if f"hf-{data}" in peers:
            rows.append(run_hf(args, data))
            log(json.dumps(rows[-1]))
    bare = [m.split("-", 1)[1] for m in peers if m.startswith("bare-")]
    if bare:
        rows += run_bare(args, bare)
    if not args.no_shardlab:
        rows += run_shardlab(args)
    device = args.device
    if args.device == "cuda":
        try:
            device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            pass
    rat = ratios(rows, args.strategy)
    (args.out / "peers.json").write_text(json.dumps({"device": device, "rows": rows, "ratios": rat}, indent=1))
    md = markdown(rows, rat, args, device)
    (args.out / "peers.md").write_text(md)
    print(md, flush=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
