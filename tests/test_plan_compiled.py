"""`--compile` runs are planned as compiled: inductor saves fewer, 16-bit tensors per decoder layer
(planning/memory.py::_compiled_layer_bytes). Checked against the H100 runs committed in benchmarks/results/ and,
on the CPU, against the saved tensors of a compiled stack whose shape the fit never saw."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from shardlab.config import RunConfig
from shardlab.planning.memory import _compiled_layer_bytes
from shardlab.planning.planner import arch_from_hf_config, plan

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
GiB = 2**30
RESHARD = {"fsdp_reshard_after_forward": True}


def _speed_cell(path: str, label: str) -> dict:
    return next(r for r in json.loads((RESULTS / path).read_text()) if r["label"] == label)["summary"]


def _run_dir(path: str) -> tuple[dict, dict]:
    d = RESULTS / path
    return yaml.safe_load((d / "config.yaml").read_text()), json.loads((d / "summary.json").read_text())


def _planned_gib(model: str, strategy: str, micro: int, **extra) -> float:
    cfg = RunConfig(model=model, strategy=strategy, seq_len=1024, micro_batch=micro, grad_accum=1, precision="bf16",
                    compile=True, **extra)
    return plan(cfg, gpu_memory_gb=80, host_ram_gb=125, strategies=(strategy,)).strategies[strategy].gpu_peak / GiB


@pytest.mark.parametrize("model,strategy,micro,extra,measured,tol", [
    # gpt2-medium dp --compile (whole model), shardlab's compiled loss and padded head: the eager plan said 40.1 GiB
    ("gpt2-medium", "dp", 16, {}, ("2026-11-26-h100-speed/call1/speed.json", "dp-compile"), 0.05),
    # fsdp --compile (bf16 parameters, no autocast); these runs resharded after forward (the default then)
    ("gpt2-medium", "fsdp", 16, {"strategy_options": RESHARD},
     ("2026-11-26-h100-speed/call1/speed.json", "fsdp-compile"), 0.05),
    # the day before, per block (compile_scope blocks) and before the padded head
    ("gpt2-medium", "fsdp", 16, {"compile_scope": "blocks", "strategy_options": RESHARD},
     ("2026-11-25-h100-speed-big/call2-speed/speed.json", "fsdp-compile"), 0.05),
])
def test_compiled_gpt2_medium_peaks_on_the_h100(model, strategy, micro, extra, measured, tol):
    summary = _speed_cell(*measured)
    assert summary["compile"] and summary["micro_batch"] == micro and summary["loss_kernel"] == "compiled"
    planned = _planned_gib(model, strategy, micro, **extra)
    assert planned == pytest.approx(summary["gpu_mem_peak_gib"], rel=tol)
    eager = plan(RunConfig(model=model, strategy=strategy, seq_len=1024, micro_batch=micro, grad_accum=1, precision="bf16",
                           strategy_options=extra.get("strategy_options", {})),
                 gpu_memory_gb=80, strategies=(strategy,)).strategies[strategy].gpu_peak / GiB
    assert eager > planned + 5  # the layers' eager tensors: several GiB more at this size


def test_compiled_llama_family_peak_on_the_h100():
    """qwen2.5-0.5b (Llama family: GQA 14/2 heads, ffn 4864 of 896) dp --compile micro 4: 13.19 GiB measured."""
    cfg, summary = _run_dir("2026-11-24-h100-modern-archs/runs/qwen2.5-0.5b-dp-compile")
    assert cfg["compile"] and cfg["model"] == "qwen2.5-0.5b"
    planned = _planned_gib(cfg["model"], cfg["strategy"], cfg["micro_batch"])
    assert planned == pytest.approx(summary["gpu_mem_peak_gib"], rel=0.05)


def _trace_module():
    spec = importlib.util.spec_from_file_location("compiled_activations", RESULTS.parent / "compiled_activations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_compiled_layer_count_holds_on_a_shape_the_fit_never_saw():
    """The Llama coefficients were fitted at kv = 1/2 and ffn = 2.67 h; here kv = 1 and ffn = 4 h, under autocast,
    compiled by inductor on this CPU. The saved tensors' bytes per layer equal the planner's count within 2%."""
    trace = _trace_module()
    hidden, heads, kv_heads, ffn = 192, 4, 4, 768
    got = trace.per_layer("llama", "autocast", 0.0, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, layers=(1, 2))
    arch = arch_from_hf_config(trace.hf_config("llama", 2, 0.0, hidden, heads, kv_heads, ffn), attn_impl="sdpa")
    per_sbh, per_as2b, per_sb = _compiled_layer_bytes(arch, "autocast", "cpu")
    planned = per_sbh + per_sb / hidden + per_as2b * heads * trace.SEQ / hidden
    assert got["compiled"]["per_layer_sbh"] == pytest.approx(planned, rel=0.02)
    assert got["eager"]["per_layer_sbh"] > 1.3 * got["compiled"]["per_layer_sbh"]  # what compiling saves here
