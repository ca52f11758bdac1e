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
from shardlab.planning.arch import arch_from_hf_config
from shardlab.planning.planner import plan

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


# fsdp --compile (the whole model, FSDP2 per block), seq 1024, bf16, no checkpointing, synthetic ids, two H200s: torch
# max_memory_allocated of the busiest rank (benchmarks/results/2026-11-28-h200x2-scaling/call6/cells.md)
MEASURED_COMPILED_H200 = [("bloom-7b1", 8, 92.82), ("llama-2-13b", 4, 101.94)]


@pytest.mark.parametrize("model, micro, measured", MEASURED_COMPILED_H200)
def test_compiled_fsdp_peaks_on_two_h200s(model, micro, measured):
    """bloom-7b1 was planned 83.13 GiB (-10.4%): its layers counted with the KV cache's k and v copies the first traces
    kept (2 p per s·b·h), and its ALiBi bias once for all layers, where FSDP2's per-block graphs each save their own
    (batch x heads x seq² bf16: 0.5 GiB a layer here). llama-2-13b was already exact (101.90)."""
    cfg = RunConfig(model=model, strategy="fsdp", seq_len=1024, micro_batch=micro, grad_accum=1, precision="bf16", gpus=2,
                    compile=True, dataset={"source": "synthetic", "eval_split": 0.0})
    sp = plan(cfg, gpu_memory_gb=139, host_ram_gb=250, strategies=("fsdp",)).strategies["fsdp"]
    assert sp.gpu_peak / GiB == pytest.approx(measured, rel=0.05)


def test_compiled_zero3_peak_on_two_h200s():
    """bloom-7b1 zero3 --compile, micro 8, two H200s: 107.53 GiB measured. ZeRO-3's hooks around every module split the
    compiled model into a graph per block, as FSDP2's do, so each block saves its own ALiBi bias (0.5 GiB a layer
    here): planned 93.00 (-13.5%) while zero3 counted one shared bias, as one whole-model graph would."""
    summary = json.loads((RESULTS / "2026-11-29-h200x2-scaling-bars/call2-bloom7b1/zero3-bloom7b1-compile.summary.json").read_text())
    cfg = RunConfig(model="bloom-7b1", strategy="zero3", seq_len=1024, micro_batch=8, grad_accum=1, precision="bf16", gpus=2,
                    compile=True, dataset={"source": "synthetic", "eval_split": 0.0})
    sp = plan(cfg, gpu_memory_gb=139, host_ram_gb=250, strategies=("zero3",)).strategies["zero3"]
    assert sp.gpu_peak / GiB == pytest.approx(summary["gpu_mem_peak_gib"], rel=0.05)
    eager = plan(cfg.model_copy(update={"compile": False}), gpu_memory_gb=139, strategies=("zero3",)).strategies["zero3"]
    bias = 2.0 * 32 * 1024 * 1024 * 8  # (batch, heads, seq, seq) in bf16, one per layer but the one eager shares
    assert sp.gpu["activations"] - eager.gpu["activations"] > 20 * bias


def test_bloom_bias_is_per_layer_only_in_per_block_graphs():
    """One whole-model graph (dp) shares BLOOM's bias as eager runs do; per-block graphs (compile_scope blocks, or
    FSDP2's hooks around each block) save one per layer and none outside. fp32: dp and fsdp count the same layers."""
    cfg = RunConfig(model="bloom-560m", seq_len=1024, micro_batch=8, precision="fp32", gpus=1, compile=True)
    layers, heads = 24, 16
    bias = 4.0 * heads * 1024 * 1024 * 8  # (batch, heads, seq, seq) in fp32

    def activations(strategy: str, **update) -> float:
        sp = plan(cfg.model_copy(update=update), gpu_memory_gb=139, strategies=(strategy,)).strategies[strategy]
        return sp.gpu["activations"]

    whole, blocks = activations("dp"), activations("dp", compile_scope="blocks")
    assert blocks - whole == pytest.approx((layers - 1) * bias)
    # FSDP2's units are blocks on several ranks (and where asked); one rank's one unit hooks only around the model
    assert activations("fsdp", gpus=2) == pytest.approx(blocks)
    as_blocks = cfg.strategy_options.model_copy(update={"fsdp_units": "blocks"})
    assert activations("fsdp", strategy_options=as_blocks) == pytest.approx(blocks)
    assert activations("fsdp") == pytest.approx(whole)


# Weak-scaling benches on two H200s, every cell at 1 and 2 GPUs, three repeats each: bloom-1b7 at micro 8, gpt2-large
# at micro 16, dp on llama-3.2-1b and bloom-1b7 at micro 16, smollm2-1.7b at micro 16 (dp also at 24), and llama-3.2-1b
# at micro 32.
SCALING_BENCHES = [RESULTS / "2026-11-29-h200x2-units/bloom-1b7/runs",
                   RESULTS / "2026-11-29-h200x2-micro16/gpt2-large/runs",
                   RESULTS / "2026-11-29-h200x2-micro16/dp-llama-bloom/runs",
                   RESULTS / "2026-11-29-h200x2-smollm2/smollm2-1.7b/runs",
                   RESULTS / "2026-11-30-h200x2-llama-m32/llama-3.2-1b/runs",
                   RESULTS / "2026-11-30-h200x2-llama-m32/smollm2-1.7b-dp-m24/runs"]


@pytest.mark.parametrize("cell", sorted(c for bench in SCALING_BENCHES for c in bench.iterdir()),
                         ids=lambda c: f"{c.parent.parent.name}/{c.name}")
def test_every_cell_of_the_two_gpu_scaling_benches_is_planned_within_5_percent(cell):
    """Replanned from each run's own config: the GPU peak within the issue's 5% of the measured one (the same in
    every repeat). bloom-1b7's fsdp --compile on one GPU was planned 48.22 GiB against 42.51: 23 ALiBi biases of
    per-block graphs counted where one unit's hooks leave one whole-model graph that shares one."""
    runs = sorted(cell.iterdir())
    measured = {round(json.loads((r / "summary.json").read_text())["gpu_mem_peak_gib"], 2) for r in runs}
    assert len(runs) == 3 and len(measured) == 1
    given = yaml.safe_load((runs[0] / "config.yaml").read_text())
    cfg = RunConfig(**given)
    sp = plan(cfg, gpu_memory_gb=139.8, host_ram_gb=251, strategies=(cfg.strategy,)).strategies[cfg.strategy]
    assert sp.gpu_peak / GiB == pytest.approx(measured.pop(), rel=0.05)


# What decides the saved tensors of a compiled graph is AOT autograd's partition with inductor's decompositions; this
# backend runs them without inductor's code generation (minutes of C++ on 2 cores), and gave the very counts inductor
# gives at both tests' shapes (benchmarks/compiled_activations.py: per_layer).
PARTITION = "aot_eager_decomp_partition"


def _trace_module():
    spec = importlib.util.spec_from_file_location("compiled_activations", RESULTS.parent / "compiled_activations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_compiled_layer_count_holds_on_a_shape_the_fit_never_saw():
    """The Llama coefficients were fitted at kv = 1/2 and ffn = 2.67 h; here kv = 1 and ffn = 4 h, under autocast,
    partitioned by inductor's min-cut partitioner on this CPU (its decompositions and partition without the C++ code
    generation: PARTITION). The saved tensors' bytes per layer equal the planner's count within 2%."""
    trace = _trace_module()
    hidden, heads, kv_heads, ffn = 192, 4, 4, 768
    got = trace.per_layer("llama", "autocast", 0.0, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, layers=(1, 2),
                         backend=PARTITION)
    arch = arch_from_hf_config(trace.hf_config("llama", 2, 0.0, hidden, heads, kv_heads, ffn), attn_impl="sdpa")
    per_sbh, per_as2b, per_sb = _compiled_layer_bytes(arch, "autocast", "cpu")
    planned = per_sbh + per_sb / hidden + per_as2b * heads * trace.SEQ / hidden
    assert got["compiled"]["per_layer_sbh"] == pytest.approx(planned, rel=0.02)
    assert got["eager"]["per_layer_sbh"] > 1.3 * got["compiled"]["per_layer_sbh"]  # what compiling saves here


@pytest.mark.slow
def test_bloom_per_block_graphs_save_the_bias_per_layer():
    """BLOOM (bf16) under FSDP2 per block on one gloo rank with the model compiled whole, as strategies/fsdp.py runs it
    on several ranks: each block's graph saves its own ALiBi bias (the planner's ``per_block`` count), against one
    whole graph that shares it.
    Hidden 64: at the script's default 192 the bias has the size of a qkv weight, which the trace leaves out."""
    trace = _trace_module()
    hidden, heads = 64, 4
    arch = arch_from_hf_config(trace.hf_config("bloom", 2, 0.0, hidden, heads, heads, 4 * hidden), attn_impl="sdpa")
    for graphs, per_block in (("fsdp", True), ("model", False)):
        got = trace.per_layer("bloom", "lp", 0.0, hidden=hidden, heads=heads, layers=(1, 2), graphs=graphs, backend=PARTITION)
        per_sbh, per_as2b, per_sb = _compiled_layer_bytes(arch, "lp", "cpu", per_block)
        planned = per_sbh + per_sb / hidden + per_as2b * heads * trace.SEQ / hidden
        # The FSDP2 trace moved between two runs on one machine (44.5 and 46.4 bytes per s.b.h a layer; cause not
        # found): 6% (2.7 bytes) for it, well below the 12 bytes per s.b.h a layer that the per-block bias adds here.
        assert got["compiled"]["per_layer_sbh"] == pytest.approx(planned, rel=0.06 if per_block else 0.02), graphs
