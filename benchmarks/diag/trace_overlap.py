"""Summarise a torch.profiler Chrome trace of a training step: per ProfilerStep the wall time, the GPU time busy with
compute kernels, with NCCL kernels, the NCCL time not hidden under compute, and the time the GPU sat idle; then where
that idle time went.

    python3 benchmarks/diag/trace_overlap.py RUN_DIR/profile/trace_rank0.json [...]
    GAP_MS=0.2 python3 benchmarks/diag/trace_overlap.py ...     # the shortest gap attributed (default 0.5 ms)

A gap is an interval with no kernel, copy or memset on the GPU. Each gap is charged to the CPU code that launched the
kernel ending it (the runtime call with the kernel's correlation id, and the profiler's CPU ops around that call on
its thread): a launch late by the whole gap means the host was busy elsewhere, e.g. waiting in a sync before it.
"""
import json
import os
import sys
from collections import defaultdict


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(iv):
    return sum(e - s for s, e in iv)


def intersect(a, b):
    i = j = 0
    out = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _complete(ev, *cats):
    return [e for e in ev if e.get("ph") == "X" and e.get("cat") in cats]


def _launcher_path(launch, cpu_ops, depth=3):
    """The innermost `depth` CPU ops on the launch call's thread that contain its start, outermost first."""
    t = launch["ts"]
    around = [o for o in cpu_ops.get(launch.get("tid"), ()) if o["ts"] <= t <= o["ts"] + o["dur"]]
    around.sort(key=lambda o: (o["ts"], -o["dur"]))
    names = [o["name"] for o in around]
    return " > ".join(names[-depth:]) or "(no CPU op around the launch)"


def load(path):
    """The trace's events (a trace of a few steps can be hundreds of MB: read it once)."""
    with open(path) as f:
        return json.load(f)["traceEvents"]


def steps_and_kernels(ev):
    """(the ProfilerStep ranges, the GPU's kernels, copies and memsets sorted by start)."""
    steps = [e for e in _complete(ev, "user_annotation") if str(e.get("name", "")).startswith("ProfilerStep")]
    return steps, sorted(_complete(ev, "kernel", "gpu_memcpy", "gpu_memset"), key=lambda k: k["ts"])


def per_step(steps, kernels):
    """Each step with its start, its end and the kernels that start within it."""
    for st in steps:
        s0, s1 = st["ts"], st["ts"] + st["dur"]
        yield st, s0, s1, [k for k in kernels if s0 <= k["ts"] < s1]


def gaps(ev, min_gap_us=500.0, extracted=None):
    """[(step name, gap start offset in the step (us), gap (us), kernel before, kernel after, launcher path, launch
    lateness (us: the launch call's start minus the gap's start))] for every idle gap of at least `min_gap_us`.
    `extracted`: steps_and_kernels(ev), where the caller has it already."""
    steps, kernels = extracted or steps_and_kernels(ev)
    launches = {e["args"]["correlation"]: e for e in _complete(ev, "cuda_runtime", "cuda_driver")
                if "correlation" in e.get("args", {})}
    cpu_ops = defaultdict(list)
    for o in _complete(ev, "cpu_op", "user_annotation", "python_function"):
        if not str(o.get("name", "")).startswith("ProfilerStep"):
            cpu_ops[o.get("tid")].append(o)
    out = []
    for st, s0, s1, ks in per_step(steps, kernels):
        busy = union([(k["ts"], k["ts"] + k["dur"]) for k in ks])
        # the gaps: step start to the first busy interval, between busy intervals, the last one to the step's end
        for start, nxt in zip([s0] + [e for _, e in busy], [s for s, _ in busy] + [s1]):
            if nxt - start < min_gap_us:
                continue
            before = max((k for k in ks if k["ts"] + k["dur"] <= start + 1e-3), key=lambda k: k["ts"] + k["dur"], default=None)
            k_after = next((k for k in ks if k["ts"] >= nxt - 1e-3), None)
            launch = launches.get(k_after.get("args", {}).get("correlation")) if k_after else None
            out.append((st["name"], start - s0, nxt - start, before["name"][:50] if before else "(step start)",
                        k_after["name"][:50] if k_after else "(step end)",
                        _launcher_path(launch, cpu_ops) if launch else "(no launch found)",
                        (launch["ts"] - start) if launch else float("nan")))
    return out


def main(path, min_gap_us=500.0):
    ev = load(path)
    steps, kernels = steps_and_kernels(ev)
    for st, _, _, ks in per_step(steps, kernels):
        nccl = union([(k["ts"], k["ts"] + k["dur"]) for k in ks if "nccl" in k["name"].lower()])
        comp = union([(k["ts"], k["ts"] + k["dur"]) for k in ks if "nccl" not in k["name"].lower()])
        busy = union(nccl + comp)
        print(f"{st['name']}: wall {st['dur']/1e3:.1f} ms | compute {length(comp)/1e3:.1f} | nccl {length(nccl)/1e3:.1f} "
              f"(exposed {(length(nccl) - intersect(nccl, comp))/1e3:.1f}) | gpu idle {(st['dur'] - length(busy))/1e3:.1f} ms")
    names = {}
    for k in kernels:
        if "nccl" in k["name"].lower():
            n = k["name"].split("(")[0][:60]
            names[n] = names.get(n, 0) + k["dur"]
    for n, d in sorted(names.items(), key=lambda x: -x[1])[:6]:
        print(f"  nccl {n}: {d/1e3/max(1, len(steps)):.1f} ms/step")
    found = gaps(ev, min_gap_us, (steps, kernels))
    if not found:
        return
    by_launcher = defaultdict(lambda: [0.0, 0])
    for *_, dur, _before, _after, launcher, _late in found:
        by_launcher[launcher][0] += dur
        by_launcher[launcher][1] += 1
    n_steps = max(1, len(steps))
    print(f"  idle gaps >= {min_gap_us/1e3:.1f} ms, by the CPU code that launched the kernel ending them (ms/step, gaps):")
    for launcher, (dur, n) in sorted(by_launcher.items(), key=lambda x: -x[1][0])[:8]:
        print(f"    {dur/1e3/n_steps:6.2f} ms  x{n:<3d} {launcher}")
    print("  the longest gaps (step, at ms, ms, kernel before -> after, launched ms after the gap began):")
    for name, at, dur, before, after, _launcher, late in sorted(found, key=lambda g: -g[2])[:6]:
        print(f"    {name} at {at/1e3:.1f}: {dur/1e3:.2f} ms  {before} -> {after}  (launch +{late/1e3:.2f})")


if __name__ == "__main__":
    gap_us = float(os.environ.get("GAP_MS", "0.5")) * 1e3
    for p in sys.argv[1:]:
        print("==", p)
        main(p, gap_us)
