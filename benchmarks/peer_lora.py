#!/usr/bin/env python3
"""The LoRA peer: HF `Trainer` + `peft`, as the PEFT docs teach it, on the model, batch, sequence length, precision and
adapter settings a `shardlab train --peft lora` cell uses, so the two are compared in the same device call.

The model is shardlab's random-init preset (its transformers config), built directly on the device in the compute
dtype, the way a user loads `from_pretrained(..., torch_dtype=torch.bfloat16)`; the data are random token ids (the
GPU machine has no tokenizer for the Llama presets), `seq` tokens per row, labels = inputs. LoRA: peft's LoraConfig
with r, alpha, dropout 0 and `target_modules="all-linear"`, shardlab's defaults. Throughput: the median step time after
3 warm-up steps (CUDA synchronised at each step end by a TrainerCallback), tokens = micro x seq per step.

    python benchmarks/peer_lora.py --model llama-2-7b --micro 8 --seq 1024 --steps 20 --out peer-lora.json
CPU smoke test (tests/test_peers.py): --model tiny-llama --device cpu --precision fp32 --micro 2 --seq 32 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("peer-lora.json"))
    args = ap.parse_args(argv)

    sys.path.insert(0, str(HERE.parent / "src"))
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from shardlab.config import RunConfig
    from shardlab.training.models import build_hf_config

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    hf_config = build_hf_config(RunConfig(model=args.model, seq_len=args.seq, device=args.device))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable, total = model.get_nb_trainable_parameters()

    vocab = hf_config.vocab_size
    rows = args.micro * (args.steps + 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, args.seq), generator=gen)
    data = [{"input_ids": r, "labels": r} for r in ids]

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            step_ends.append(time.perf_counter())

        def on_step_end(self, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

    targs = TrainingArguments(
        output_dir=str(args.out.parent / "hf-peft-run"), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-4, warmup_steps=1,
        bf16=args.precision == "bf16" and cuda, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=not cuda, seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[StepClock()])
    t0 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t0
    dts = [b - a for a, b in zip(step_ends, step_ends[1:])]
    timed = dts[WARMUP:] if len(dts) > WARMUP else dts
    med = statistics.median(timed)
    record = {
        "peer": "hf-trainer-peft-lora", "engine": "transformers.Trainer + peft LoRA", "model": args.model,
        "micro": args.micro, "seq": args.seq, "precision": args.precision, "r": args.r, "alpha": args.alpha,
        "target_modules": "all-linear", "trainable_params": trainable, "total_params": total, "steps": len(dts),
        "timed_steps": len(timed), "step_time_median_s": med, "tokens_per_s": args.micro * args.seq / med,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "wall_s": wall,
        "train_loss": result.training_loss,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
