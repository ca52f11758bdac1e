"""Summarise a torch.profiler Chrome trace of a multi-rank step: per ProfilerStep the wall time, the GPU time busy with
compute kernels, with NCCL kernels, the NCCL time not hidden under compute, and the time the GPU sat idle.

    python3 benchmarks/diag/trace_overlap.py RUN_DIR/profile/trace_rank0.json
"""
import json
import sys


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


def main(path):
    ev = json.load(open(path))["traceEvents"]
    steps = [e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep") and e.get("cat") == "user_annotation"]
    kernels = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for st in steps:
        s0, s1 = st["ts"], st["ts"] + st["dur"]
        ks = [k for k in kernels if s0 <= k["ts"] < s1]
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


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("==", p)
        main(p)
