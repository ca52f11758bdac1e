#!/usr/bin/env bash
# One device call (issue 14, items 1 and 5): host RAM and GPU peak of big-model offload runs beside what
# `shardlab plan` predicted for them. bloom-3b under zero2_offload / zero3_offload / fsdp_offload for a few
# steps, then, while the call's time allows, bloom-7b1 (zero2_offload is expected to be *refused* on a
# 125 GiB host with pinned buffers: the refusal line is recorded as its result). The runs are the lines of
# benchmarks/cells/big-host.txt, run by the bench's runner (`shardlab bench --cells`: a fresh process per run, the
# line's own time limit, failures recorded with their reason, no run started that would not end within BUDGET_S;
# finished runs are kept, so a second call on the same machine continues).
#   bash benchmarks/gpu_big_host.sh              (repo root, GPU machine, .whl carried; one H100, <= 9 min)
#   BUDGET_S=500 STEPS=4 bash benchmarks/gpu_big_host.sh
# Results: $OUT/big_host.md (the table), $OUT/big_host.jsonl (one row per run), $OUT/skipped.txt (cells the budget
# left out), $OUT/logs/, $OUT/summaries/ (the runs' summary.json), $OUT/bench.json.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/logs" "$OUT/summaries"
BUDGET_S="${BUDGET_S:-500}"   # start no run that would not end within this (the call's limit is 600 s of command time)
STEPS="${STEPS:-4}"
B=/tmp/big-host
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
free -g | tee "$OUT/free.txt"
nproc | tee "$OUT/nproc.txt"
COMMON="--precision bf16 --seq-len 1024 --grad-accum 1 --max-steps $STEPS --dataset synthetic --set dataset.synthetic_tokens=200000
  --eval-split 0.02 --set eval_every=1000 --no-export --log-every 1 --gradient-checkpointing"
python3 -m shardlab bench --cells benchmarks/cells/big-host.txt --cell-flags "$COMMON" --budget-s "$(( BUDGET_S - SECONDS ))" \
  --no-report --output-dir "$B"
cp "$B/bench.json" "$OUT/"
python3 - "$B" "$OUT" <<'PY'
import json, shutil, sys
from pathlib import Path
import yaml
b, out = Path(sys.argv[1]), Path(sys.argv[2])
rows, skipped = [], []
for cell in json.loads((b / "bench.json").read_text())["cells"]:
    name, cfg = cell["label"], yaml.safe_load((b / cell["config"]).read_text())
    if not cell["repeats"]:
        skipped.append(f"skip {name}: not started, it would not have ended within the budget")
        continue
    rec = cell["repeats"][-1]
    run, log = b / rec["run_dir"], b / rec["log"]
    if log.is_file():
        shutil.copy(log, out / "logs" / f"{name}.log")
    row = {"name": name, "model": cfg.get("model"), "strategy": cfg.get("strategy"), "status": rec["status"],
           "rc": rec.get("exit_code")}
    if (run / "summary.json").is_file():
        shutil.copy(run / "summary.json", out / "summaries" / f"{name}.json")
    if rec["status"] == "ok":
        s = json.loads((run / "summary.json").read_text()); plan = s.get("plan") or {}
        row.update(plan_host_gib=plan.get("cpu_gib"), plan_gpu_gib=plan.get("gpu_peak_gib"),
                   host_rank_gib=s.get("cpu_rss_max_rank_gib"),
                   host_tree_gib=((s.get("cpu_monitor") or {}).get("real_mb") or {}).get("peak", 0) * 1e6 / 2**30 or None,
                   gpu_gib=s.get("gpu_mem_peak_gib"), tok_s=s.get("tokens_per_s"), steps=s.get("steps"))
    else:  # refused (the one-line UserError), out of memory, timed out or crashed: the bench's reason
        row.update(kind=rec.get("kind"), reason=rec.get("reason"))
    rows.append(row)
(out / "big_host.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(out / "skipped.txt").write_text("".join(s + "\n" for s in skipped))
print("".join(s + "\n" for s in skipped), end="")
PY
python3 - "$OUT" <<'PY' | tee "$OUT/big_host.md"
import json, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "big_host.jsonl").read_text().splitlines() if l.strip()]
f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
err = lambda p, m: "-" if p is None or not m else f"{(p - m) / m:+.1%}"  # noqa: E731
print("| run | model | strategy | plan host GiB | rank RSS peak GiB | err | process tree peak GiB | plan GPU GiB | GPU peak GiB | err | tok/s | result |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    result = "ok" if r["status"] == "ok" else f"refused/failed ({r.get('kind')}, exit {r['rc']}): {r.get('reason') or ''}"[:240]
    print(f"| {r['name']} | {r['model']} | {r['strategy']} | {f(r.get('plan_host_gib'))} | {f(r.get('host_rank_gib'))} | "
          f"{err(r.get('plan_host_gib'), r.get('host_rank_gib'))} | {f(r.get('host_tree_gib'))} | {f(r.get('plan_gpu_gib'))} | "
          f"{f(r.get('gpu_gib'))} | {err(r.get('plan_gpu_gib'), r.get('gpu_gib'))} | {f(r.get('tok_s'))} | {result} |")
PY
