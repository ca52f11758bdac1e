"""Host (Python) work a training step costs, per strategy, with the arithmetic made negligible.

Runs one shardlab rank in this process on the CPU with a model of a real preset's module tree (same layers, blocks and
parameter count per block shape) but a tiny width, so that a step's wall time is almost all framework work: the hooks,
the bookkeeping and the per-tensor operators that stay the same at any width. That is the part of a one-GPU step the
GPU cannot hide once a strategy is host-bound (issue 15's zero3). Optionally profiles the timed steps (cProfile).

    python3 benchmarks/diag/host_overhead.py --like gpt2-medium --strategy zero3 --steps 30 [--profile out.pstats]

Prints the median step wall time (ms) over the steps after --warmup; writes only the profile asked for.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", default="gpt2-medium", help="the preset whose module tree is copied")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--profile", default=None, help="write a cProfile of the timed steps here")
    ap.add_argument("--set", nargs="*", default=[], help="KEY=VALUE config overrides (YAML values)")
    args = ap.parse_args()

    import dataclasses

    import yaml

    from shardlab.config import load_config
    from shardlab.training import presets
    from shardlab.training import trainer as T

    base = presets.PRESETS[args.like]
    conf = dict(base.config)
    for k in ("n_embd", "hidden_size"):
        if k in conf:
            conf[k] = args.width
    for k in ("n_head", "num_attention_heads", "num_key_value_heads"):
        if k in conf:
            conf[k] = 4
    for k in ("intermediate_size",):
        if k in conf:
            conf[k] = 4 * args.width
    name = f"narrow-{args.like}"
    presets.PRESETS[name] = dataclasses.replace(base, name=name, config=conf, hub_id=None)

    extra = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        extra[k] = yaml.safe_load(v)
    kw = dict(model=name, strategy=args.strategy, device="cpu", gpus=1, seq_len=args.seq_len, micro_batch=1,
              max_steps=args.steps, precision=args.precision, eval_at_start=False, eval_every=10**6,
              log_every=10**6, dataset={"source": "synthetic"}, output_dir=f"/tmp/host_overhead_{os.getpid()}")
    cfg = load_config(sets={**kw, **extra})
    cfg.export = False
    times: list[float] = []
    prof = cProfile.Profile() if args.profile else None
    orig = T.Trainer._train_step

    def step(self, strategy, batches):
        n = len(times)
        timed = n >= args.warmup
        if prof and timed:
            prof.enable()
        t0 = time.perf_counter()
        try:
            return orig(self, strategy, batches)
        finally:
            times.append(time.perf_counter() - t0)
            if prof and timed:
                prof.disable()

    T.Trainer._train_step = step
    T.run_worker(cfg)
    steady = times[args.warmup:]
    print(f"{args.strategy} like {args.like} width {args.width}: median step {1e3 * statistics.median(steady):.1f} ms "
          f"(min {1e3 * min(steady):.1f}, max {1e3 * max(steady):.1f}) over {len(steady)} steps")
    if prof:
        prof.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
