"""Where the GPU sits idle in one profiled step (issue 15, fsdp on one GPU): a --profile trace's second step, its GPU
idle gaps over 0.3 ms with the annotations (FSDP::*, Optimizer.step, ...) the host was in meanwhile, and the step's
annotations by host time.

    python3 benchmarks/diag/fsdp_trace_gaps.py RUN/profile/trace_rank0.json(.gz)
"""
import json, gzip, collections, sys
t = json.load(gzip.open(sys.argv[1]) if sys.argv[1].endswith(".gz") else open(sys.argv[1]))
ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
steps = sorted([e for e in ev if e["name"].startswith("ProfilerStep") and e.get("cat") == "user_annotation"], key=lambda e: e["ts"])
ann = [e for e in ev if e.get("cat") in ("user_annotation",) and not e["name"].startswith("ProfilerStep")]
pyf = [e for e in ev if e.get("cat") == "python_function"]
print("categories", collections.Counter(e.get("cat") for e in ev).most_common(12))
st = steps[1] if len(steps) > 1 else steps[0]
s0, s1 = st["ts"], st["ts"] + st["dur"]
print("step", st["name"], "dur ms", st["dur"]/1e3)
# gpu gaps within the step
g = [e for e in gpu if s0 <= e["ts"] <= s1]
gaps = []
last = s0
for e in g:
    if e["ts"] - last > 300:
        gaps.append((last, e["ts"]))
    last = max(last, e["ts"] + e["dur"])
if s1 - last > 300: gaps.append((last, s1))
print("gpu busy in step ms", sum(e["dur"] for e in g)/1e3, "gaps>0.3ms:", len(gaps), "total", sum(b-a for a,b in gaps)/1e3)
for a, b in gaps:
    # annotations overlapping the gap
    over = collections.Counter()
    for e in ann:
        lo, hi = max(a, e["ts"]), min(b, e["ts"] + e["dur"])
        if hi > lo: over[e["name"][:60]] += hi - lo
    print(f"  gap at {(a-s0)/1e3:7.1f} ms len {(b-a)/1e3:6.1f} ms:", [(k, round(v/1e3,1)) for k, v in over.most_common(4)])
# top annotations durations in the step
d = collections.Counter(); n = collections.Counter()
for e in ann:
    if s0 <= e["ts"] <= s1: d[e["name"][:70]] += e["dur"]; n[e["name"][:70]] += 1
print("annotations in the step (CPU ms):")
for k, v in d.most_common(25): print(f"  {k:70s} n={n[k]:4d} {v/1e3:7.2f}")
