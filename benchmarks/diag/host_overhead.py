"""Host (Python) work a training step costs, and one-rank ZeRO-3's shortcuts compared inside one run.

Runs one shardlab rank in this process. On the CPU (the default) the model is a real preset's module tree (same
layers and blocks) at a tiny width, so that a step's wall time is mostly framework work: the hooks, the bookkeeping
and the per-tensor operators that stay the same at any width, which is what a one-GPU step cannot hide once the
strategy is host-bound (issue 15's zero3). On a GPU, ``--width 0`` keeps the preset's width.

``--modes`` (zero3 on one rank) switches the one-rank shortcuts and the foreach norm between steps: step k runs mode
``modes[(k // period) % len(modes)]``, so every mode sees the same stretches of the host CPU's speed (a one-GPU
host's speed drifts by up to 1.7x for seconds at a time: 2026-11-27-h100-zero3-gc), and the comparison is within one
process. A mode is "none", "all", or shortcut names joined by "+". A step's time is from its start to the next
step's start (the loop's own work included; the step ends in the loss' .item(), a device sync).

    python3 benchmarks/diag/host_overhead.py --strategy zero3 --steps 60            # CPU, gpt2-medium's tree, width 64
    python3 benchmarks/diag/host_overhead.py --device cuda --width 0 --seq-len 1024 --micro-batch 8 --precision bf16 \\
        --strategy zero3 --steps 205 --modes none,all,keep_gathered,identity_reduce_scatter,foreach_norm --period 4

Prints one line per mode (median, quartiles, steps) and, with --json, writes them; writes only what it is asked to.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import time


def _switch(strategy, installed: dict) -> callable:
    """A function that turns the named shortcuts on (the rest off) on this engine, and stage 3's module name."""
    from deepspeed.runtime.zero import stage3

    from shardlab.compat import zero3_one_rank

    opt = strategy.engine.optimizer
    own = {"pap": type(opt)._partition_all_parameters.__get__(opt), "norm": type(opt)._get_norm_groups.__get__(opt)}
    short = {"pap": opt._partition_all_parameters, "norm": opt._get_norm_groups}
    rs_short = stage3.reduce_scatter_coalesced
    rs_own = getattr(rs_short, "__wrapped__", rs_short)
    assert installed == list(zero3_one_rank.SHORTCUTS), installed

    def to(mode: str) -> None:
        every = {*zero3_one_rank.SHORTCUTS, "foreach_norm"}  # the norm is compat/zero3_norm.py's, on any number of ranks
        on = every if mode == "all" else set() if mode == "none" else set(mode.split("+"))
        opt._partition_all_parameters = short["pap"] if "keep_gathered" in on else own["pap"]
        opt._get_norm_groups = short["norm"] if "foreach_norm" in on else own["norm"]
        stage3.reduce_scatter_coalesced = rs_short if "identity_reduce_scatter" in on else rs_own

    return to


def main() -> None:  # noqa: C901 - a one-off diagnostic script, kept as it was run
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", default="gpt2-medium", help="the preset whose module tree is copied")
    ap.add_argument("--width", type=int, default=64, help="the model's width (0: the preset's own)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=0, help="the model's vocabulary (0: the preset's own)")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--modes", default=None, help="zero3 on one rank: comma-separated shortcut modes to interleave")
    ap.add_argument("--period", type=int, default=4, help="steps per mode before the next")
    ap.add_argument("--json", default=None, help="write the per-mode figures here")
    ap.add_argument("--profile", default=None, help="write a cProfile of the timed steps here")
    ap.add_argument("--set", nargs="*", default=[], help="KEY=VALUE config overrides (YAML values)")
    args = ap.parse_args()

    import dataclasses

    import yaml

    from shardlab.config import load_config
    from shardlab.training import presets
    from shardlab.loop import trainer as T

    name = args.like
    if args.width:
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
        if args.vocab:
            conf["vocab_size"] = args.vocab
        name = f"narrow-{args.like}"
        presets.PRESETS[name] = dataclasses.replace(base, name=name, config=conf, hub_id=None)

    extra = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        extra[k] = yaml.safe_load(v)
    kw = dict(model=name, strategy=args.strategy, device=args.device, gpus=1, seq_len=args.seq_len,
              micro_batch=args.micro_batch, max_steps=args.steps, precision=args.precision, eval_at_start=False,
              eval_every=10**6, log_every=10**6, max_grad_norm=None, dataset={"source": "synthetic"},
              output_dir=f"/tmp/host_overhead_{os.getpid()}")
    cfg = load_config(sets={**kw, **extra})
    cfg.export = False
    modes = args.modes.split(",") if args.modes else ["default"]
    starts: list[float] = []
    step_modes: list[str] = []
    switch = [None]
    prof = cProfile.Profile() if args.profile else None
    orig = T.Trainer._train_step

    def step(self, strategy, batches):
        k = len(starts)
        mode = modes[(k // args.period) % len(modes)]
        if args.modes:
            if switch[0] is None:
                switch[0] = _switch(strategy, strategy.one_rank_shortcuts)
            switch[0](mode)
        step_modes.append(mode)
        timed = k >= args.warmup
        if prof and timed:
            prof.enable()
        starts.append(time.perf_counter())
        try:
            return orig(self, strategy, batches)
        finally:
            if prof and timed:
                prof.disable()

    T.Trainer._train_step = step
    T.run_worker(cfg)
    durations = [b - a for a, b in zip(starts, starts[1:])]
    out = {}
    for mode in modes:
        xs = sorted(d for k, d in enumerate(durations) if k >= args.warmup and step_modes[k] == mode)
        if not xs:
            continue
        q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
        out[mode] = {"median_ms": 1e3 * statistics.median(xs), "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2], "steps": len(xs)}
        print(f"{args.strategy} [{mode}] like {args.like} width {args.width or 'preset'}: median step "
              f"{out[mode]['median_ms']:.1f} ms (quartiles {out[mode]['q1_ms']:.1f}-{out[mode]['q3_ms']:.1f}) over {len(xs)} steps",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "modes": out, "durations_s": durations, "step_modes": step_modes}, f)
    if prof:
        prof.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
