"""Issue 15 (speed) on one GPU: shardlab cells side by side with the bare loops, with the runs' own
compile_time_s / time_to_first_step_s and the planner's predicted peak beside each measured peak.

Cells are `foundation_gpu.run_cell` runs (same command line: synthetic fully packed data, seq 1024, bf16,
no clipping, no export) plus the ones this issue adds: BLOOM with shardlab's SDPA attention against its
eager attention, fsdp --compile, and a second dp --compile run to show the compiled-graph cache.
Cells run in the order given until --budget-s is spent (a cell is skipped when the time left is less
than its expected length), so one device call always returns a table.

    python3 benchmarks/speed_gpu.py --bare $OUT/speed/bare.jsonl --out $OUT/speed --cells bloom-sdpa,bloom-eager,...
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import foundation_gpu as fg

# label -> (model, expected wall seconds on an H100 with a cold cache: a cell is skipped when less time is left)
MODEL = {"bloom-sdpa": "bloom-560m", "bloom-eager": "bloom-560m", "bloom-sdpa-cudnn": "bloom-560m"}
EXPECTED_S = {"bloom-sdpa": 60, "bloom-eager": 70, "dp": 45, "dp-compile": 150, "dp-compile-again": 60, "fsdp-compile": 170,
              "zero1": 60, "zero2": 60, "zero3": 110, "zero3-gather": 110, "fsdp-noreshard": 60, "dp-nopad": 45, "dp-compile-nopad": 150,
              "fsdp": 60, "fsdp-compile-model": 170, "fsdp-compile-blocks": 60, "fsdp-compile-noreshard": 60, "zero1-compile": 150, "zero2-compile": 150, "zero3-compile": 170, "zero3-deepcompile": 200, "zero3-deepcompile-flash": 200, "fsdp-compile-reshard": 60,
              "fsdp-compile-blocks-noreshard": 60, "dp-compile-blocks": 150,
              "fsdp-blocks": 60, "fsdp-model-nogather": 60, "fsdp-compile-units-blocks": 120, "fsdp-compile-model-nogather": 120,
              "dp-cudnn": 45, "dp-compile-cudnn": 150, "dp-compile-autotune": 400, "dp-compile-cudagraphs": 170,
              "bloom-sdpa-cudnn": 60, "dp-compile-closs-noeval": 60, "dp-compile-liger-noeval": 60,
              "zero1-nocheck": 60, "zero2-nocheck": 60, "zero1-check": 60, "zero2-check": 60,
              "zero3-leaf": 110, "zero3-leaf-nocg": 110, "zero3-hooks": 110, "zero3-blocks": 110, "zero3-blocks-nocg": 110,
              "zero3-combo-pf0": 110, "zero3-combo-leaf": 110, "zero3-combo-leaf-pf0": 110,
              "dp-nopin": 45, "zero3-before": 110, "zero3-nopin": 110,
              "zero3-own": 110, "zero3-keep": 110, "zero3-rs": 110, "zero3-norm": 110}  # warm inductor cache (the first is ~100)


def ds_cell(strategy: str, config: str) -> tuple:
    """A micro-8 cell of `strategy` run with the DeepSpeed JSON benchmarks/cells/CONFIG.json."""
    return (strategy, 8, ["--deepspeed-config", f"benchmarks/cells/{config}.json"], None)


fg.CELLS.update({
    "bloom-sdpa": ("dp", 8, ["--attn-implementation", "sdpa"], None),  # shardlab.compat.bloom_sdpa (what auto picks)
    "bloom-eager": ("dp", 8, ["--attn-implementation", "eager"], None),  # transformers' eager BLOOM: seq² fp32 scores
    "dp-compile-again": fg.CELLS["dp-compile"],  # same configuration again: inductor's caches should be hit
    "fsdp-compile": ("fsdp", 16, ["--compile"], None),  # compile_scope auto = blocks for fsdp (training/compiling.py)
    "fsdp-compile-model": ("fsdp", 16, ["--compile", "--set", "compile_scope=model"], None),  # one whole-model graph
    "dp-compile-blocks": ("dp", 16, ["--compile", "--set", "compile_scope=blocks"], None),
    "fsdp-compile-blocks": ("fsdp", 16, ["--compile", "--set", "compile_scope=blocks"], None),
    # DeepSpeed's own engine.compile (strategies/deepspeed_zero.py), same micro batch as dp-compile
    "zero1-compile": ("zero1", 16, ["--compile"], None),
    "zero2-compile": ("zero2", 16, ["--compile"], None),
    "zero3-compile": ("zero3", 16, ["--compile"], None),
    # DeepSpeed's DeepCompile for ZeRO-3 (its compiler passes own the gathers and releases), through a user JSON
    "zero3-deepcompile": ("zero3", 16, ["--compile", "--deepspeed-config", "benchmarks/cells/deepcompile.json"], None),
    # with the default (cuDNN) attention DeepCompile's graph fails in inductor's code (2026-11-26-h100-speed/call7)
    "zero3-deepcompile-flash": ("zero3", 16, ["--compile", "--deepspeed-config", "benchmarks/cells/deepcompile.json",
                                              "--set", "sdpa_backend=flash"], None),
    # one rank: resharding after forward frees a bf16 copy that backward then gathers again (benchmarks/gpu_fsdp_compile.sh);
    # since strategies/fsdp.reshard_after_forward, not resharding is fsdp's default on one rank: "-reshard" is the other way
    "fsdp-compile-reshard": ("fsdp", 16, ["--compile", "--set", "strategy_options.fsdp_reshard_after_forward=true"], None),
    "fsdp-compile-noreshard": ("fsdp", 16, ["--compile", "--set", "strategy_options.fsdp_reshard_after_forward=false"], None),
    "fsdp-compile-blocks-noreshard": ("fsdp", 16, ["--compile", "--set", "compile_scope=blocks", "--set",
                                                   "strategy_options.fsdp_reshard_after_forward=false"], None),
    # zero3 as it was before one rank kept every parameter whole (DeepSpeed's default persistence threshold)
    "zero3-gather": ("zero3", 8, ["--set", "strategy_options.stage3_param_persistence_threshold=100000"], None),
    "fsdp-noreshard": ("fsdp", 8, ["--set", "strategy_options.fsdp_reshard_after_forward=false"], None),
    # one rank, as before fsdp_units and fsdp_gather_after_step (strategies/fsdp.py): a unit per block, gathered in forward
    "fsdp-blocks": ("fsdp", 8, ["--set", "strategy_options.fsdp_units=blocks", "--set", "strategy_options.fsdp_gather_after_step=false"], None),
    "fsdp-compile-units-blocks": ("fsdp", 16, ["--compile", "--set", "strategy_options.fsdp_units=blocks", "--set",
                                               "strategy_options.fsdp_gather_after_step=false"], None),
    "fsdp-model-nogather": ("fsdp", 8, ["--set", "strategy_options.fsdp_gather_after_step=false"], None),
    "fsdp-compile-model-nogather": ("fsdp", 16, ["--compile", "--set", "strategy_options.fsdp_gather_after_step=false"], None),
    # the output head's matmul on GPT-2's own 50,257-token vocabulary (before training/head_padding.py)
    "dp-nopad": ("dp", 8, ["--set", "pad_head=false"], None),
    "dp-compile-nopad": ("dp", 16, ["--compile", "--set", "pad_head=false"], None),
    # loss_kernel side by side (benchmarks/gpu_liger.sh): no eval split, so that each run compiles one graph (an eval
    # under no_grad compiles a second one) and three interleaved repeats fit one device call
    "dp-compile-closs-noeval": ("dp", 16, ["--compile", "--set", "loss_kernel=compiled", "--eval-split", "0"], None),
    "dp-compile-liger-noeval": ("dp", 16, ["--compile", "--set", "loss_kernel=liger", "--eval-split", "0"], None),
    # attention kernel and compile mode (training/attention_backend.py, training/compiling.py; benchmarks/gpu_attention.sh)
    "dp-cudnn": ("dp", 8, ["--set", "sdpa_backend=cudnn"], None),
    "dp-compile-cudnn": ("dp", 16, ["--compile", "--set", "sdpa_backend=cudnn"], None),
    "dp-compile-autotune": ("dp", 16, ["--compile", "--set", "compile_mode=max-autotune-no-cudagraphs"], None),
    "dp-compile-cudagraphs": ("dp", 16, ["--compile", "--set", "compile_mode=reduce-overhead"], None),
    "bloom-sdpa-cudnn": ("dp", 8, ["--attn-implementation", "sdpa", "--set", "sdpa_backend=cudnn"], None),
    # issue 15, zero1/zero2 on one GPU: no per-parameter overflow check (and its .item()) and no per-parameter grad norm
    # in DeepSpeed's step (benchmarks/cells/zero-nocheck.json: bf16.check_grad_overflow, zero_optimization.compute_grad_norm)
    "zero1-nocheck": ds_cell("zero1", "zero-nocheck"),
    "zero2-nocheck": ds_cell("zero2", "zero-nocheck"),
    # as before deepspeed_config.bf16_overflow_check: DeepSpeed's default per-gradient check (benchmarks/cells/zero-check.json)
    "zero1-check": ds_cell("zero1", "zero-check"),
    "zero2-check": ds_cell("zero2", "zero-check"),
    # issue 15, zero3 on one GPU: the whole model one ZeRO-3 leaf module (stage3_module_granularity_threshold), so the
    # parameter coordinator's fetch/release hooks run on the root module only, not on each of its ~300 submodules
    "zero3-leaf": ds_cell("zero3", "zero3-leaf"),
    "zero3-leaf-nocg": ds_cell("zero3", "zero3-leaf-nocg"),
    # gpt2-medium's 24 GPT2Blocks as leaves (granularity 1,399,580 <= 1.5e6 < GPT2Model's 1,612,832), root not a leaf
    "zero3-blocks": ds_cell("zero3", "zero3-blocks"),
    # the same plus contiguous_gradients: false (no copy of each reduced gradient into one contiguous buffer)
    "zero3-blocks-nocg": ds_cell("zero3", "zero3-blocks-nocg"),
    # as before: hooks on every submodule (DeepSpeed's default threshold 0; benchmarks/cells/zero3-hooks.json)
    "zero3-hooks": ds_cell("zero3", "zero3-hooks"),
    # 2026-11-27-h100-zero3-combo: zero3-blocks-nocg plus stage3_prefetch_bucket_size 0 (every parameter is persistent
    # on one rank: nothing to prefetch, so the coordinator skips its prefetch scan of the parameter trace)
    "zero3-combo-pf0": ds_cell("zero3", "zero3-combo-pf0"),
    # the blocks made leaves by DeepSpeed's leaf_module.classes (what set_z3_leaf_modules does; no "fast sharding" of the
    # threshold path), contiguous_gradients false; then also prefetch 0
    "zero3-combo-leaf": ds_cell("zero3", "zero3-combo-leaf"),
    "zero3-combo-leaf-pf0": ds_cell("zero3", "zero3-combo-leaf-pf0"),
    # 2026-11-27-h100-zero3-pin: the defaults pin the training thread (pin_thread auto) and give one-rank zero3 block
    # leaves + contiguous_gradients off; these cells turn that back off (pin_thread off; zero3-before: the JSON of
    # before, leaf_module.classes [] and contiguous_gradients true over the generated config)
    "dp-nopin": ("dp", 8, ["--pin-thread", "off"], None),
    "zero3-before": ("zero3", 8, ["--pin-thread", "off", "--deepspeed-config", "benchmarks/cells/zero3-before.json"], None),
    "zero3-nopin": ("zero3", 8, ["--pin-thread", "off"], None),
    # 2026-11-27-h100-zero3-one-rank: one-rank ZeRO-3's shortcuts (compat/zero3_one_rank.py; all three are the
    # default): none of them (DeepSpeed's own path), then each alone
    "zero3-own": ("zero3", 8, ["--set", "strategy_options.zero3_one_rank_shortcuts=[]"], None),
    "zero3-keep": ("zero3", 8, ["--set", "strategy_options.zero3_one_rank_shortcuts=[keep_gathered]"], None),
    "zero3-rs": ("zero3", 8, ["--set", "strategy_options.zero3_one_rank_shortcuts=[identity_reduce_scatter]"], None),
    "zero3-norm": ("zero3", 8, ["--set", "strategy_options.zero3_one_rank_shortcuts=[foreach_norm]"], None),
})
# cell -> the cell or bare mode it is compared with, and the goal for that ratio
VERSUS = {"bloom-sdpa": ("bloom-eager", None), "dp-compile": ("bare:compile-bf16", 1.10), "dp-compile-again": ("bare:compile-bf16", 1.10),
          "fsdp-compile": ("dp-compile", 0.95), "fsdp-compile-model": ("dp-compile", 0.95),
          "fsdp-compile-blocks": ("dp-compile", 0.95), "zero1-compile": ("dp-compile", None),
          "zero2-compile": ("dp-compile", None), "zero3-compile": ("dp-compile", None), "zero3-deepcompile": ("dp-compile", None), "zero3-deepcompile-flash": ("dp-compile", None), "fsdp-compile-reshard": ("dp-compile", 0.95), "fsdp-compile-noreshard": ("dp-compile", 0.95),
          "fsdp-compile-blocks-noreshard": ("dp-compile", 0.95),
          "dp-compile-blocks": ("bare:compile-bf16", 1.10), "dp-compile-closs-noeval": ("bare:compile-bf16", 1.10),
          "dp-compile-liger-noeval": ("bare:compile-bf16", 1.10), "fsdp": ("dp", 1.0), "dp": ("bare:eager-bf16", 1.0), "zero3": ("dp", 0.7), "zero3-gather": ("dp", 0.7), "fsdp-noreshard": ("dp", 1.0), "fsdp-blocks": ("dp", 1.0), "fsdp-model-nogather": ("dp", 1.0),
          "fsdp-compile-units-blocks": ("dp-compile", 0.95), "fsdp-compile-model-nogather": ("dp-compile", 0.95), "dp-nopad": ("bare:eager-bf16", None),
          "dp-compile-nopad": ("bare:compile-bf16", 1.10), "dp-cudnn": ("dp", None), "dp-compile-cudnn": ("bare:compile-bf16", 1.10),
          "dp-compile-autotune": ("bare:compile-bf16", 1.10), "dp-compile-cudagraphs": ("bare:compile-bf16", 1.10),
          "bloom-sdpa-cudnn": ("bloom-sdpa", None), "zero1": ("dp", 0.95), "zero2": ("dp", 0.95),
          "zero1-nocheck": ("dp", 0.95), "zero2-nocheck": ("dp", 0.95),
          "zero1-check": ("dp", 0.95), "zero2-check": ("dp", 0.95),
          "zero3-leaf": ("dp", 0.7), "zero3-leaf-nocg": ("dp", 0.7), "zero3-hooks": ("dp", 0.7), "zero3-blocks": ("dp", 0.7), "zero3-blocks-nocg": ("dp", 0.7),
          "zero3-combo-pf0": ("dp", 0.7), "zero3-combo-leaf": ("dp", 0.7), "zero3-combo-leaf-pf0": ("dp", 0.7),
          "dp-nopin": ("dp", None), "zero3-before": ("dp", 0.7), "zero3-nopin": ("dp", 0.7),
          "zero3-own": ("dp", 0.7), "zero3-keep": ("dp", 0.7), "zero3-rs": ("dp", 0.7), "zero3-norm": ("dp", 0.7)}
BLOOM_GOAL_TOKS, BLOOM_GOAL_PEAK = 1.5 * 37.5e3, 24.0  # issue 15: bloom-560m dp eager, micro 8


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def table(rows: list[dict], bare: dict[str, list[dict]]) -> str:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["label"], []).append(r)
    tps = {k: _med([r["summary"]["tokens_per_s"] for r in v if "summary" in r]) for k, v in by.items()}
    for mode, recs in bare.items():
        tps[f"bare:{mode}"] = _med([r["tokens_per_s_median"] for r in recs])
    lines = ["| cell | model | micro | runs | tok/s median (min–max) | MFU | peak GiB | planned peak GiB (err) | compile_time_s | "
             "time_to_first_step_s | cache hit | versus | ratio | goal |", "|" + "---|" * 14]
    for label, runs in by.items():
        strategy, micro, extra, _ = fg.CELLS[label]
        ok = [r["summary"] for r in runs if "summary" in r]
        if not ok:
            lines.append(f"| {label} | {MODEL.get(label, 'gpt2-medium')} | {micro} | {len(runs)} | failed (rc {runs[-1]['rc']}) |" + " |" * 9)
            continue
        peak = max(s.get("gpu_mem_peak_gib", float("nan")) for s in ok)
        planned = (ok[0].get("plan") or {}).get("gpu_peak_gib")
        err = f"{planned:.1f} ({planned / peak - 1:+.1%})" if planned else "-"
        mfu = _med([s["mfu"] for s in ok if s.get("mfu") is not None])
        ref, goal = VERSUS.get(label, (None, None))
        ratio = tps[label] / tps[ref] if ref and tps.get(ref) else None
        verdict = "" if ratio is None or goal is None else ("✅" if ratio >= goal else "❌") + f" ≥{goal}"
        if label == "bloom-sdpa":
            verdict = (f"{'✅' if tps[label] >= BLOOM_GOAL_TOKS else '❌'} ≥{BLOOM_GOAL_TOKS:,.0f} tok/s, "
                       f"{'✅' if peak <= BLOOM_GOAL_PEAK else '❌'} ≤{BLOOM_GOAL_PEAK} GiB")
        spread = [s["tokens_per_s"] for s in ok]
        lines.append(
            f"| {label} | {MODEL.get(label, 'gpt2-medium')} | {micro} | {len(ok)} | {tps[label]:,.0f} ({min(spread):,.0f}–{max(spread):,.0f}) | "
            f"{'' if mfu is None else f'{mfu:.1%}'} | {peak:.2f} | {err} | "
            f"{_med([s.get('compile_time_s') or 0.0 for s in ok]):.1f} | {_med([s.get('time_to_first_step_s') or 0.0 for s in ok]):.1f} | "
            f"{(ok[-1].get('compile_cache') or {}).get('hit')} | {ref or '-'} | {'' if ratio is None else f'{ratio:.3f}'} | {verdict} |")
    for mode, recs in bare.items():
        lines.append(f"| bare:{mode} | {recs[0].get('model', 'gpt2-medium')} | {recs[0].get('micro')} | {len(recs)} | {tps[f'bare:{mode}']:,.0f} | | "
                     f"{max(r['peak_alloc_gib'] for r in recs):.2f} | | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bare", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default="/tmp/shardlab-speed-runs")
    p.add_argument("--cells", required=True)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting cells when this little time is left")
    p.add_argument("--table-only", action="store_true")
    args = p.parse_args()
    t_end = time.time() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "speed.json"
    rows = json.loads(results.read_text()) if results.is_file() else []
    if not args.table_only:
        for label in args.cells.split(","):
            if time.time() + EXPECTED_S.get(label, 90) > t_end:
                print(f"[{label}] skipped: {t_end - time.time():.0f} s of the budget left", flush=True)
                continue
            cell_args = copy.copy(args)
            cell_args.model = MODEL.get(label, "gpt2-medium")
            cell_args.runs = f"{args.runs}/{len(rows)}"  # a repeat of a cell gets a fresh run directory
            row = fg.run_cell(label, cell_args)
            row.get("summary", {}).pop("memory_per_rank", None)
            rows.append(row)
            results.write_text(json.dumps(rows, indent=1))  # a killed session keeps what finished
    md = table(rows, fg.load_bare(args.bare))
    print(md)
    (out / "speed.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
