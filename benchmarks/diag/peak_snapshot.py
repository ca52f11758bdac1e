"""What is alive on the GPU at a run's peak: a planner check (issue 15: compiled peaks planned +6%).

Runs one shardlab worker in this process (the configuration of an earlier run: its run directory's config.yaml) with
torch's CUDA allocator history on from the start, then replays the history: the moment the allocated bytes peak, and
the blocks alive then, grouped by the first frame that says what made them (shardlab, transformers, an inductor
graph, torch's autograd or optimizer). Prints the groups; no snapshot pickle is kept (they are hundreds of MB).

    python3 benchmarks/diag/peak_snapshot.py RUN_DIR [--steps 3] [--top 30]
    python3 benchmarks/diag/peak_snapshot.py CONFIG.yaml --innermost [--set key=value ...]
    torchrun --nproc-per-node 2 benchmarks/diag/peak_snapshot.py CONFIG.yaml --innermost   # every rank prints its own

RUN_DIR is an earlier run's directory (its config.yaml) or a config file itself. ``--innermost`` groups by the
innermost telling frame instead (DeepSpeed's own allocations, made inside hooks that shardlab's loop calls, then name
DeepSpeed's line rather than shardlab's ``engine.backward``), with the outermost shardlab frame beside it. Under
torchrun each rank replays its own GPU's history.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

KEYS = ("/shardlab/", "/transformers/", "torchinductor", "/torch/optim/", "/torch/distributed/", "/deepspeed/")


def where(frames: list[dict]) -> str:
    """The allocation's first telling frame: file:line function, most specific first (frames are innermost first)."""
    for key in KEYS:
        for f in frames:
            if key in f["filename"]:
                return f"{f['filename'].split(key)[-1]}:{f['line']} {f['name']}"
    return frames[0]["name"] if frames else "?"


def innermost(frames: list[dict]) -> str:
    """The innermost telling frame (any of KEYS), then the shardlab frame that led there."""
    inner = next((f for f in frames if any(k in f["filename"] for k in KEYS)), None)
    outer = next((f for f in reversed(frames) if "/shardlab/" in f["filename"]), None)
    fmt = lambda f: f"{f['filename'].split('site-packages/')[-1].split('/src/')[-1]}:{f['line']} {f['name']}"
    out = fmt(inner) if inner else (frames[0]["name"] if frames else "?")
    if outer is not None and outer is not inner:
        out += f"  <- {fmt(outer)}"
    return out


def replay(trace: list[dict], free: str = "free_requested"):
    """(peak bytes, event index, live blocks at the peak). ``free``: the event that ends a block. torch's allocated
    counter drops at free_completed, which comes later than free_requested for a block used on another stream
    (record_stream: DeepSpeed's reduce stream), so the two replays differ where such blocks are in flight."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == free and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > peak:
            peak, peak_at = cur, i
    live = {}
    for e in trace[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == free:
            live.pop(e["addr"], None)
    return peak, peak_at, list(live.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--innermost", action="store_true")
    ap.add_argument("--recent", type=int, default=25, help="large (>= 32 MiB) events to list before the peak")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    label = innermost if args.innermost else where
    from shardlab.config import load_config
    from shardlab.training.trainer import run_worker

    from shardlab.config import parse_set

    path = args.run_dir if args.run_dir.endswith((".yaml", ".yml")) else os.path.join(args.run_dir, "config.yaml")
    out_dir = os.environ.get("SNAP_OUTPUT_DIR") or args.run_dir.rstrip("/").removesuffix(".yaml") + "-snap"
    cfg = load_config(path, sets={"max_steps": args.steps, "profile": False, "output_dir": out_dir, "export": False,
                                  **parse_set(args.set)})
    if "LOCAL_RANK" in os.environ:  # torchrun: record on this rank's GPU, no context on GPU 0
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # context="alloc": stacks for allocations only. With free stacks too ("all"), a non-reentrant checkpoint's early stop
    # (an exception raised inside the recomputed forward) freed tensors while the exception was pending, the stack
    # capture cleared it, and DeepSpeed's LinearFunctionForZeroStage3.apply failed with "returned NULL without setting
    # an exception" (torch 2.11, Python 3.12, ZeRO-3). The early stop is turned off as well: it only skips the rest of a
    # block's forward once every tensor its backward needs is recomputed, so the peaks stay the same.
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, context="alloc", stacks="python")
    from torch.utils.checkpoint import set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        run_worker(cfg)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.cuda.current_device()
    rank = int(os.environ.get("RANK", "0"))
    trace = snap["device_traces"][dev]
    gib = 2**30
    print(f"[rank {rank}, cuda:{dev}] events {len(trace)}; torch max_memory_allocated "
          f"{torch.cuda.max_memory_allocated() / gib:.3f} GiB")
    for free in ("free_requested", "free_completed"):
        peak, at, blocks = replay(trace, free)
        print(f"--- replay freeing at {free}: peak {peak / gib:.3f} GiB at event {at}")
        if at >= 0:
            print("peak moment:", label(trace[at].get("frames", [])))
            big = [(i, e) for i, e in enumerate(trace[: at + 1]) if e["size"] >= 32 * 2**20
                   and e["action"] in ("alloc", free)][-args.recent:]
            for i, e in big:  # the large allocations and frees just before the peak
                print(f"   ev {i:8d} {e['action']:14s} {e['size'] / gib:7.3f} GiB  {label(e.get('frames', []))}")
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for b in blocks:
            groups[label(b.get("frames", []))].append(b["size"])
        rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
        for name, sizes in rows[: args.top]:
            print(f"{sum(sizes) / gib:8.3f} GiB  {len(sizes):5d} blocks  max {max(sizes) / gib:6.3f}  {name}")
        rest = sum(sum(s) for _, s in rows[args.top:])
        print(f"{rest / gib:8.3f} GiB  (the other {max(0, len(rows) - args.top)} groups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
