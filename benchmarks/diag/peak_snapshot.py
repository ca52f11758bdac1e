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


MARKERS: dict[int, str] = {}  # allocation size (bytes) -> marker name


def mark(name: str) -> None:
    """A marker in the allocator's history: one allocation of a size kept for this name alone (1000 + k blocks of
    512 B, under 1 MiB; no tensor of these runs has such a size), freed at once. Costs no Python stack capture."""
    size = next((sz for sz, n in MARKERS.items() if n == name), None)
    if size is None:
        size = (1000 + len(MARKERS) + 1) * 512
        MARKERS[size] = name
    torch.empty(size, dtype=torch.uint8, device="cuda")


MARKED = [  # (module, class, attribute, marker name): engine phases and ZeRO-3's gradient and step paths
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "forward", "forward"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "backward", "backward"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "step", "step"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
     "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", "reduce_ipg"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "partition_grads", "partition_grads"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_offload_grad_partition_at_boundary", "offload_grad"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "independent_gradient_partition_epilogue", "epilogue"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_finalize_offload_gradient_accumulation", "finalize_accum"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_optimizer_step", "optimizer_step"),
    ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator", "fetch_sub_module", "fetch"),
    ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator", "release_sub_module", "release"),
]
TOP = ("forward", "backward", "step")


def install_markers() -> None:
    import functools
    import importlib

    for mod, cls, attr, name in MARKED:
        klass = getattr(importlib.import_module(mod), cls)
        f = getattr(klass, attr)

        def wrapped(*a, __f=f, __name=name, **k):
            mark(__name + ">")
            out = __f(*a, **k)
            mark(__name + "<")
            return out

        setattr(klass, attr, functools.wraps(f)(wrapped))


def marker_report(trace: list[dict], free: str, peak_at: int, blocks: list[dict], recent: int) -> None:
    """Peaks between the engine's phases, the events just before the peak, and the live blocks grouped by size and by
    the marker that preceded their allocation."""
    gib, mib = 2**30, 2**20
    live: dict[int, int] = {}
    cur, phase, phase_peak, phase_n = 0, "start", 0, collections.Counter()
    last_marker: dict[int, str] = {}
    current = "start"
    rows = []
    for i, e in enumerate(trace):
        a, size = e["action"], e["size"]
        if a == "alloc" and size in MARKERS:
            name = MARKERS[size]
            current = name
            if name.rstrip("<>") in TOP:
                rows.append((phase, phase_peak))
                phase_n[name] += 1
                phase, phase_peak = f"{name}#{phase_n[name]}", cur
            continue
        if a == "alloc":
            live[e["addr"]] = size
            last_marker[i] = current
            cur += size
        elif a == free and e["addr"] in live:
            cur -= live.pop(e["addr"])
        phase_peak = max(phase_peak, cur)
    rows.append((phase, phase_peak))
    print("peak allocated between the engine's phase markers (GiB):")
    print("   " + "  ".join(f"{p}:{v / gib:.2f}" for p, v in rows))
    # the events before the peak: markers, and allocations/frees of >= 32 MiB
    ev = []
    for i in range(peak_at, -1, -1):
        e = trace[i]
        if e["action"] == "alloc" and e["size"] in MARKERS:
            n = MARKERS[e["size"]]
            if not n.startswith(("fetch", "release")):
                ev.append(f"   ev {i:8d} marker {n}")
        elif e["size"] >= 32 * mib and e["action"] in ("alloc", free):
            ev.append(f"   ev {i:8d} {e['action']:14s} {e['size'] / mib:9.1f} MiB")
        if len(ev) >= recent:
            break
    print(f"the last {len(ev)} markers and >= 32 MiB events up to the peak (event {peak_at}):")
    print("\n".join(reversed(ev)))
    index = {id(e): i for i, e in enumerate(trace)}
    groups: dict[tuple[int, str], list[int]] = collections.defaultdict(list)
    for b in blocks:
        if b["size"] in MARKERS:
            continue
        groups[(b["size"] // mib if b["size"] >= 8 * mib else -1, last_marker.get(index[id(b)], "?"))].append(b["size"])
    print("live blocks at the peak by size (MiB; -1: under 8 MiB) and the marker before their allocation:")
    for (sz, m), sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:40]:
        print(f"   {sum(sizes) / gib:8.3f} GiB  {len(sizes):5d} x {sz:7d} MiB  after {m}")


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
    ap.add_argument("--markers", action="store_true",
                    help="no Python stacks: record sizes only, with marker allocations at DeepSpeed's phases (MARKED)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    label = innermost if args.innermost else where
    from shardlab.config import load_config
    from shardlab.loop.trainer import run_worker

    from shardlab.config import parse_set

    path = args.run_dir if args.run_dir.endswith((".yaml", ".yml")) else os.path.join(args.run_dir, "config.yaml")
    out_dir = os.environ.get("SNAP_OUTPUT_DIR") or args.run_dir.rstrip("/").removesuffix(".yaml") + "-snap"
    cfg = load_config(path, sets={"max_steps": args.steps, "profile": False, "output_dir": out_dir, "export": False,
                                  **parse_set(args.set)})
    if "LOCAL_RANK" in os.environ:  # torchrun: record on this rank's GPU, no context on GPU 0
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # ZeRO-3 with checkpointing: Python stack capture in the allocator broke DeepSpeed's recompute (torch 2.11, Python
    # 3.12: LinearFunctionForZeroStage3.apply "returned NULL without setting an exception", when the non-reentrant
    # checkpoint's early stop raised inside the recomputed forward and a free captured a stack meanwhile); turning the
    # early stop off breaks ZeRO-3 instead (it recomputes past the block into released parameters). --markers records
    # no stacks at all and tells the phases by marker allocations.
    if args.markers:
        install_markers()
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, context=None, stacks="python")
    else:
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
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
        if at >= 0 and not args.markers:
            print("peak moment:", label(trace[at].get("frames", [])))
            big = [(i, e) for i, e in enumerate(trace[: at + 1]) if e["size"] >= 32 * 2**20
                   and e["action"] in ("alloc", free)][-args.recent:]
            for i, e in big:  # the large allocations and frees just before the peak
                print(f"   ev {i:8d} {e['action']:14s} {e['size'] / gib:7.3f} GiB  {label(e.get('frames', []))}")
        if args.markers:
            marker_report(trace, free, at, blocks, args.recent)
            continue
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
