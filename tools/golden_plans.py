"""The golden plans: what `shardlab plan` predicts for every preset x strategy x a few shapes, kept as data so that a
change to the planner that moves a figure is seen, and said, in the commit that makes it.

    python -m tools.golden_plans --check   # list the figures the planner now gives differently (exit 1 if any)
    python -m tools.golden_plans --write   # rewrite tests/data/golden_plans.json from the planner as it is

Each case is one config planned the way the CLI plans it: GPU cases through ``planner.plan`` (every strategy, GPU and
host memory, every moment weighed, the per-GPU stages of a pipeline, the largest micro batch and the recommendation),
CPU cases through ``strategy_plan.predict_cpu_run`` (a CPU run's allocations and its whole host figure) for the small
presets. Figures are whole bytes; tests/test_plan_golden.py recomputes them all and compares.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden_plans.json"

# GPU shapes, planned for every preset: ranks, micro x accum, sequence length, checkpointing, compile, precision
GPU_SHAPES = {
    "1gpu-m1-s512": dict(gpus=1, micro_batch=1, grad_accum=1, seq_len=512),
    "1gpu-m8-s1024-ckpt": dict(gpus=1, micro_batch=8, grad_accum=1, seq_len=1024, gradient_checkpointing=True),
    "1gpu-m8x4-s1024": dict(gpus=1, micro_batch=8, grad_accum=4, seq_len=1024),
    "2gpu-m8x2-s1024-ckpt": dict(gpus=2, micro_batch=8, grad_accum=2, seq_len=1024, gradient_checkpointing=True),
    "2gpu-m1-s512": dict(gpus=2, micro_batch=1, grad_accum=1, seq_len=512),
    "1gpu-m8-s1024-compile": dict(gpus=1, micro_batch=8, grad_accum=1, seq_len=1024, compile=True),
}
# Options that change what an engine holds, planned for one model of each family
OPTION_SHAPES = {
    "2gpu-m2x2-s512-fp32": dict(gpus=2, micro_batch=2, grad_accum=2, seq_len=512, precision="fp32"),
    "1gpu-m4-s512-liger": dict(gpus=1, micro_batch=4, grad_accum=1, seq_len=512, loss_kernel="liger"),
    "1gpu-m4-s512-hf-loss": dict(gpus=1, micro_batch=4, grad_accum=1, seq_len=512, loss_kernel="hf"),
    "1gpu-m4-s512-8bit-in-backward-bf16": dict(gpus=1, micro_batch=4, grad_accum=1, seq_len=512, optimizer="adamw8bit",
                                                optimizer_in_backward=True, master_weights="bf16"),
    "2gpu-m4x2-s512-8bit": dict(gpus=2, micro_batch=4, grad_accum=2, seq_len=512, optimizer="adamw8bit"),
    "2gpu-m2x4-s512-offload-ratio": dict(gpus=2, micro_batch=2, grad_accum=4, seq_len=512,
                                         strategy_options={"offload_ratio": 0.5, "pin_memory": False}),
    "1gpu-m2-s512-no-eval": dict(gpus=1, micro_batch=2, grad_accum=1, seq_len=512, dataset={"eval_split": 0.0}),
}
OPTION_MODELS = ("gpt2-medium", "bloom-560m", "smollm2-360m", "qwen2.5-0.5b")
# CPU shapes (a CPU run's allocations), planned for the small presets
CPU_SHAPES = {
    "cpu-1rank-m2-s256": dict(gpus=1, micro_batch=2, grad_accum=1, seq_len=256, precision="fp32"),
    "cpu-2rank-m1x2-s256": dict(gpus=2, micro_batch=1, grad_accum=2, seq_len=256, precision="fp32"),
}
CPU_MODELS = ("tiny-gpt2", "tiny-bloom", "tiny-llama", "gpt2", "smollm2-135m")
GPU_MEMORY_GB, HOST_RAM_GB, NVME_FREE_GB = 80, 250, 4000
MAX_SEARCH = 4  # the largest micro batch searched (plan's default is 4096): the search itself is microbatch.largest_that_fits
LABEL = 32  # a moment's or a host buffer's name is kept to its first LABEL characters (the data stays small)


def cases() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(case id, model, 'gpu' or 'cpu', config fields) of every golden case."""
    from shardlab.training.presets import PRESETS

    out = [(f"{m}/{k}", m, "gpu", v) for m in PRESETS for k, v in GPU_SHAPES.items()]
    out += [(f"{m}/{k}", m, "gpu", v) for m in OPTION_MODELS for k, v in OPTION_SHAPES.items()]
    out += [(f"{m}/{k}", m, "cpu", v) for m in CPU_MODELS for k, v in CPU_SHAPES.items()]
    return out


def _b(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def _named(d: dict[str, float]) -> dict[str, int | None]:
    out = {k[:LABEL]: _b(v) for k, v in d.items()}
    assert len(out) == len(d), f"two names share their first {LABEL} characters: {list(d)}"
    return out


def _strategy_figures(sp) -> dict[str, Any]:
    row = {
        "gpu_peak": _b(sp.gpu_peak), "peak_moment": sp.peak_moment, "gpu": {k: _b(v) for k, v in sp.gpu.items()},
        "moments": _named(sp.moments), "cpu_per_node": _b(sp.cpu_per_node),
        "cpu_detail": _named(sp.cpu_detail), "nvme_per_node": _b(sp.nvme_per_node),
        "model_state_bytes_per_param": round(sp.model_state_bytes_per_param, 6),
        "paper_bytes_per_param": sp.paper_bytes_per_param, "deepspeed_gpu": _b(sp.deepspeed_gpu),
        "deepspeed_cpu": _b(sp.deepspeed_cpu), "micro_x_accum": f"{sp.micro_batch}x{sp.grad_accum}",
    }
    if sp.stages:
        row["stages"] = [{"gpu": e["gpu"], "stages": e["stages"], "blocks": e["blocks"], "peak": _b(e["peak"]),
                          "moment": e["moment"]} for e in sp.stages]
    return row


def _gpu_case(cfg) -> dict[str, Any]:
    from shardlab.planning.planner import plan

    p = plan(cfg, gpu_memory_gb=GPU_MEMORY_GB, host_ram_gb=HOST_RAM_GB, nvme_free_gb=NVME_FREE_GB, max_search=MAX_SEARCH)
    out: dict[str, Any] = {"recommendation": p.recommendation, "next_option": p.next_option,
                           "recommended_flags": p.recommended_flags}
    for s, sp in p.strategies.items():
        out[s] = {**_strategy_figures(sp), "fits": sp.fits, "max_micro_batch": sp.max_micro_batch}
    if p.recommended_plan is not None:
        out["recommended_plan"] = _strategy_figures(p.recommended_plan)
    return out


def _cpu_case(cfg) -> dict[str, Any]:
    from shardlab.errors import UserError
    from shardlab.planning.strategy_plan import predict_cpu_run
    from shardlab.specs.registry import names

    out: dict[str, Any] = {}
    for s in names():
        one = cfg.model_copy(update={"strategy": s}).with_pipeline_microbatches(cfg.gpus)[0]
        try:
            sp, total = predict_cpu_run(one, cfg.gpus, reuse_heap=True)
        except UserError as err:
            out[s] = {"error": err.message}
            continue
        out[s] = {**_strategy_figures(sp), "cpu_run": _b(total)}
    return out


# Config fields that do not change the architecture read from a model (arch.read_arch; seq_len is checked against the
# model, not read): that reading (a meta-device model built with transformers, most of this tool's time) is shared by
# the cases that differ only in these.
NOT_ARCH = {"strategy", "gpus", "micro_batch", "grad_accum", "global_batch", "gradient_checkpointing", "compile", "precision",
            "loss_kernel", "optimizer", "optimizer_in_backward", "master_weights", "dataset", "strategy_options", "seq_len"}


def compute() -> dict[str, Any]:
    from shardlab.config import RunConfig
    from shardlab.planning import arch as architecture

    read, memo = architecture.read_arch, {}

    def arch(cfg):
        key = (cfg.model_dump_json(exclude=NOT_ARCH), cfg.strategy_options.stage3_param_persistence_threshold)
        if key not in memo:
            memo[key] = read(cfg)
        return copy.deepcopy(memo[key])

    out = {}
    architecture.read_arch = arch  # every reader looks it up there (planning/arch.py)
    try:
        for case, model, device, fields in cases():
            cfg = RunConfig(model=model, **fields)
            out[case] = _gpu_case(cfg) if device == "gpu" else _cpu_case(cfg)
    finally:
        architecture.read_arch = read
    return out


def _walk(old: Any, new: Any, path: str, out: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            if k not in new:
                out.append(f"{path}/{k}: gone (was {_short(old[k])})")
            elif k not in old:
                out.append(f"{path}/{k}: new ({_short(new[k])})")
            else:
                _walk(old[k], new[k], f"{path}/{k}", out)
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            _walk(a, b, f"{path}[{i}]", out)
    elif isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        if abs(old - new) > max(2, 1e-9 * abs(old)):  # whole bytes; a sum taken in another order may round apart
            rel = f" ({(new - old) / old:+.2%})" if old else ""
            out.append(f"{path}: {old} -> {new}{rel}")
    elif old != new:
        out.append(f"{path}: {_short(old)} -> {_short(new)}")


def _short(x: Any) -> str:
    text = json.dumps(x)
    return text if len(text) < 100 else text[:97] + "..."


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every figure of ``new`` that is not ``old``'s, as 'case/strategy/key: old -> new'."""
    out: list[str] = []
    _walk(old, new, "", out)
    return [line.lstrip("/") for line in out]


def dumps(golden: dict[str, Any]) -> str:
    """The data as JSON with one line per strategy of a case: small, and a diff names the case and strategy moved."""
    line = lambda x: json.dumps(x, sort_keys=True, separators=(",", ":"))  # noqa: E731
    cases = [f" {json.dumps(case)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {line(v)}" for k, v in sorted(rows.items()))
             + "\n }" for case, rows in sorted(golden.items())]
    return "{\n" + ",\n".join(cases) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {GOLDEN.relative_to(ROOT)}")
    parser.add_argument("--check", action="store_true", help="list the figures that differ (the default)")
    args = parser.parse_args(argv)
    new = compute()
    if args.write:
        GOLDEN.write_text(dumps(new))
        print(f"wrote {GOLDEN.relative_to(ROOT)}: {len(new)} cases")
        return 0
    diff = differences(json.loads(GOLDEN.read_text()), new)
    print("\n".join(diff) or "the golden plans are unchanged")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
