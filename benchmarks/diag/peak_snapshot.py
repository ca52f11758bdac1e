"""What is alive on the GPU at a run's peak: a planner check (issue 15: compiled peaks planned +6%).

Runs one shardlab worker in this process (the configuration of an earlier run: its run directory's config.yaml) with
torch's CUDA allocator history on from the start, then replays the history: the moment the allocated bytes peak, and
the blocks alive then, grouped by the first frame that says what made them (shardlab, transformers, an inductor
graph, torch's autograd or optimizer). Prints the groups; no snapshot pickle is kept (they are hundreds of MB).

    python3 benchmarks/diag/peak_snapshot.py RUN_DIR [--steps 3] [--top 30]
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


def replay(trace: list[dict]):
    """(peak bytes, live blocks at the peak): allocated bytes as torch counts them (freed at free_requested)."""
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > peak:
            peak, peak_at = cur, i
    live = {}
    for e in trace[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return peak, peak_at, list(live.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from shardlab.config import load_config
    from shardlab.training.trainer import run_worker

    cfg = load_config(os.path.join(args.run_dir, "config.yaml"),
                      sets={"max_steps": args.steps, "profile": False, "output_dir": args.run_dir.rstrip("/") + "-snap",
                            "export": False})
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    run_worker(cfg)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    peak, at, blocks = replay(trace)
    gib = 2**30
    print(f"events {len(trace)}; replayed peak {peak / gib:.3f} GiB at event {at}; "
          f"torch max_memory_allocated {torch.cuda.max_memory_allocated() / gib:.3f} GiB")
    if at >= 0:
        print("peak moment:", where(trace[at].get("frames", [])))
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for b in blocks:
        groups[where(b.get("frames", []))].append(b["size"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    for name, sizes in rows[: args.top]:
        print(f"{sum(sizes) / gib:8.3f} GiB  {len(sizes):5d} blocks  {name}")
    rest = sum(sum(s) for _, s in rows[args.top:])
    print(f"{rest / gib:8.3f} GiB  (the other {max(0, len(rows) - args.top)} groups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
