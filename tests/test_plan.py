"""`shardlab plan`: model-state formulas, parameter counts, activations against exact CPU
measurements, a bloom-7b1 plan on one 80 GB GPU, the documented error against H100 runs, bad inputs."""

from __future__ import annotations

import functools
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from shardlab.cli import main
from shardlab.config import RunConfig
from shardlab.errors import UserError
from shardlab.specs.registry import names as strategy_names
from shardlab.planning.arch import arch_from_hf_config
from shardlab.planning.memory import GiB
from shardlab.planning.planner import activation_bytes, plan
from shardlab.planning.strategy_plan import model_state_bytes_per_param, paper_bytes_per_param

# Measured H100 peaks (GiB) per strategy: tests/data/README.md says where they come from.
MEASURED_H100 = json.loads((Path(__file__).parent / "data" / "h100_foundation_peaks.json").read_text())

# ---- model states: the ZeRO paper's formulas, exactly ---------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_model_states_equal_zero_paper(d):
    paper = {
        "zero0": Fraction(16),
        "zero1": Fraction(4) + Fraction(12, d),
        "zero2": Fraction(2) + Fraction(14, d),
        "zero3": Fraction(16, d),
    }
    for strategy, expected in paper.items():
        assert model_state_bytes_per_param(strategy, d, "bf16") == expected, strategy
        assert paper_bytes_per_param(strategy, d) == expected
    assert model_state_bytes_per_param("dp", d, "bf16") == 16  # fp32 weights + grads + m, v under autocast
    assert model_state_bytes_per_param("fsdp", d, "bf16") == Fraction(16, d)
    assert model_state_bytes_per_param("zero0", d, "fp32") == 16  # 4 + 4 + 8


def test_plan_model_states_in_bytes():
    cfg = RunConfig(model="gpt2-medium", seq_len=256, micro_batch=1, precision="bf16", gpus=4)
    p = plan(cfg, gpu_memory_gb=80)
    n = p.n_params
    for s, per_param in (("zero1", 4 + 12 / 4), ("zero2", 2 + 14 / 4), ("fsdp", 16 / 4)):
        sp = p.strategies[s]
        assert sp.gpu["parameters"] + sp.gpu["gradients"] + sp.gpu["optimizer"] == pytest.approx(n * per_param)
        assert sp.model_state_bytes_per_param == pytest.approx(per_param)
    # ZeRO-3's gradient partition lives in a persistent flat buffer, dp's gradients in DDP's buckets (views of them):
    # both shown under 'temporary'
    assert p.strategies["zero3"].model_state_bytes_per_param == pytest.approx(16 / 4)
    dp = p.strategies["dp"]
    assert dp.model_state_bytes_per_param == 16 and dp.gpu["gradients"] == 0
    assert dp.gpu["parameters"] + dp.gpu["optimizer"] == pytest.approx(n * (4 + 8))


def test_deepspeed_estimator_transcription_matches_deepspeed():
    ds12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    ds3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    from shardlab.strategies.memory.deepspeed_zero import ds_zero2_formula as _ds_zero2_formula, ds_zero3_formula as _ds_zero3_formula

    for n, ll, g, nodes in ((354_823_168, 51_463_168, 1, 1), (7_069_016_064, 1_027_604_480, 8, 2)):
        for off in (True, False):
            assert _ds_zero2_formula(n, g, nodes, cpu_offload=off) == ds12.estimate_zero2_model_states_mem_needs(n, g, nodes, cpu_offload=off)
            for offp in (True, False):
                for zi in (True, False):
                    assert _ds_zero3_formula(n, ll, g, nodes, off, offp, zi) == ds3.estimate_zero3_model_states_mem_needs(n, ll, g, nodes, off, offp, zi)


# ---- parameter counts from the meta device ---------------------------------------------------------


@pytest.mark.parametrize(
    "name,count",
    [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("bloom-560m", 559_214_592), ("bloom-7b1", 7_069_016_064)],
)
def test_meta_param_counts_known_presets(name, count):
    from shardlab.training.models import build_hf_config

    arch = arch_from_hf_config(build_hf_config(RunConfig(model=name)))
    assert arch.n_params == count


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bloom"])
def test_meta_param_counts_equal_real_models(name):
    from shardlab.training.models import build_hf_config, build_model, model_summary

    cfg = RunConfig(model=name, device="cpu")
    arch = arch_from_hf_config(build_hf_config(cfg))
    assert arch.n_params == model_summary(build_model(cfg))["n_params"]


# ---- activations against exact CPU measurements -----------------------------------------------------


def _saved_tensors(model, micro: int, seq: int, autocast: bool = False) -> dict[int, tuple[int, torch.dtype, tuple]]:
    """What autograd holds when forward returns: (bytes, dtype, shape) per unique storage packed by saved-tensor hooks,
    parameters excluded. ``autocast``: the forward under CPU bf16 autocast over the model's fp32 weights (dp's mode)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, torch.dtype, tuple]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), t.dtype, tuple(t.shape))
        return t

    ids = torch.randint(0, 1000, (micro, seq), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids, use_cache=False)
    return seen


def _saved_bytes(model, micro: int, seq: int) -> int:
    """Bytes autograd holds when forward returns (``_saved_tensors``). Exact on CPU (no allocator caching, unlike RSS)."""
    return sum(nbytes for nbytes, _, _ in _saved_tensors(model, micro, seq).values())


TINY_CASES = [(name, attn, ckpt) for name, attn in (("tiny-gpt2", "sdpa"), ("tiny-bloom", "eager")) for ckpt in (False, True)]
WIDE_CASES = [(family, dtype, dropout) for family in ("gpt2", "bloom", "llama") for dtype in ("float32", "bfloat16") for dropout in (0.0, 0.1)
              if not (family == "llama" and dropout)]  # fmt: skip  (Llama has no residual dropout)
TINY_BOUND, WIDE_BOUND = 0.25, 0.10


@functools.cache
def tiny_errors(name: str, attn: str, ckpt: bool) -> dict[tuple[int, int], tuple[float, float]]:
    """(seq, micro) -> (predicted, measured) saved-activation bytes of a tiny preset; measured once per session."""
    from shardlab.training.models import build_hf_config, build_model

    cfg = RunConfig(model=name, device="cpu", attn_implementation=attn, gradient_checkpointing=ckpt)
    model = build_model(cfg)
    arch = arch_from_hf_config(build_hf_config(cfg), attn_impl=attn)
    return {(seq, micro): (activation_bytes(arch, micro, seq, "fp32", "cpu", ckpt).saved_at_forward_end, _saved_bytes(model, micro, seq))
            for seq in (64, 128) for micro in (2, 4)}  # fmt: skip


@pytest.mark.parametrize("name,attn,ckpt", TINY_CASES)
def test_activation_estimate_tiny_presets(name, attn, ckpt):
    for (seq, micro), (predicted, measured) in tiny_errors(name, attn, ckpt).items():
        assert abs(predicted / measured - 1) < TINY_BOUND, (name, ckpt, seq, micro, predicted, measured)


@pytest.mark.parametrize("family,dtype,dropout", WIDE_CASES)
def test_activation_layers_wide_models(family, dtype, dropout):
    for (seq, micro), (predicted, measured) in wide_errors(family, dtype, dropout).items():
        assert abs(predicted / measured - 1) < WIDE_BOUND, (family, dtype, dropout, seq, micro, predicted, measured)


def test_autocast_casts_an_activation_once_per_projection():
    """dp's bf16 mode runs fp32 weights under autocast, which caches the 16-bit casts of leaf tensors (the weights)
    only: Llama's q, k and v projections each cast the fp32 RMSNorm output and save their own 16-bit copy, and gate
    and up do the same, where GPT-2's fused c_attn and c_fc cast once. smollm2-360m dp on an H100 peaked 1.57 GiB above
    a plan that counted one copy per norm (18.82 / 17.25 GiB); the plan counts all five now."""
    import collections

    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardlab.planning.memory import _layer_bytes

    transformers.logging.set_verbosity_error()
    h, micro, seq = 256, 2, 64

    def linear_inputs_per_layer(layers: int) -> collections.Counter:
        c = LlamaConfig(num_hidden_layers=layers, hidden_size=h, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=688, vocab_size=1000, bos_token_id=0, eos_token_id=0)
        model = AutoModelForCausalLM.from_config(c, dtype=torch.float32, attn_implementation="sdpa")
        return collections.Counter((dtype, shape) for _, dtype, shape in _saved_tensors(model, micro, seq, autocast=True).values())

    two, four = linear_inputs_per_layer(2), linear_inputs_per_layer(4)
    copy = (torch.bfloat16, (micro * seq, h))  # a 16-bit, hidden-wide input saved by a projection
    assert (four[copy] - two[copy]) / 2 == 6  # q, k, v, o_proj, gate, up: five casts of norm outputs and o_proj's input
    arch = arch_from_hf_config(LlamaConfig(num_hidden_layers=2, hidden_size=h, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=688, vocab_size=1000), attn_impl="sdpa")
    # autocast against 16-bit weights: each norm's fp32 output (2 x 2 B more) and the three casts beyond one a norm
    assert _layer_bytes(arch, "autocast", "cuda")[0] - _layer_bytes(arch, "lp", "cuda")[0] == pytest.approx(2 * 2 + 3 * 2)


@functools.cache
def wide_errors(family: str, dtype: str, dropout: float) -> dict[tuple[int, int], tuple[float, float]]:
    """The tiny presets are dominated by the 50k-vocab logits; a wide, small-vocab model checks the
    per-layer counts ('lp' = weights and compute in 16-bit, as under DeepSpeed / FSDP2)."""
    import transformers
    from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig

    transformers.logging.set_verbosity_error()
    h, a, layers = 256, 4, 2
    if family == "gpt2":
        c = GPT2Config(n_layer=layers, n_embd=h, n_head=a, vocab_size=1000, resid_pdrop=dropout, attn_pdrop=dropout, embd_pdrop=dropout, bos_token_id=0, eos_token_id=0)
        attn = "sdpa"
    elif family == "bloom":
        c = BloomConfig(n_layer=layers, hidden_size=h, n_head=a, vocab_size=1000, hidden_dropout=dropout, attention_dropout=dropout, bos_token_id=0, eos_token_id=0)
        attn = "eager"
    else:
        c = LlamaConfig(num_hidden_layers=layers, hidden_size=h, num_attention_heads=a, num_key_value_heads=2, intermediate_size=688, vocab_size=1000, bos_token_id=0, eos_token_id=0)
        attn = "sdpa"
    model = AutoModelForCausalLM.from_config(c, dtype=getattr(torch, dtype), attn_implementation=attn)
    arch = arch_from_hf_config(c, attn_impl=attn)
    mode = "fp32" if dtype == "float32" else "lp"
    return {(seq, micro): (activation_bytes(arch, micro, seq, mode, "cpu").saved_at_forward_end, _saved_bytes(model, micro, seq))
            for seq, micro in ((64, 2), (128, 4))}  # fmt: skip


# ---- bloom-7b1 on one 80 GB GPU -----------------------------------------------------------------------


def test_bloom_7b1_on_one_80gb_gpu():
    cfg = RunConfig(model="bloom-7b1", seq_len=512, micro_batch=1, precision="bf16", gpus=1)
    p = plan(cfg, gpu_memory_gb=80)
    s = p.strategies
    assert p.n_params == 7_069_016_064
    # 7.07e9 x 16 B = 113 GB of model states alone
    assert not s["dp"].fits and "GPU needs" in s["dp"].why and s["dp"].max_micro_batch == 0
    assert s["dp"].gpu_peak >= 7_069_016_064 * 16 * 0.99
    for name in ("zero0", "zero1", "zero2", "zero3", "fsdp"):  # one GPU: nothing to shard across
        assert not s[name].fits, name
    for name in ("zero2_offload", "zero3_offload", "infinity", "fsdp_offload"):
        assert s[name].fits, (name, s[name].why)
        assert s[name].max_micro_batch >= 1
    assert s["infinity"].nvme_per_node == 7_069_016_064 * 14
    assert p.recommendation == "zero2_offload"
    assert "faster ones do not fit" in p.reason
    # with too little host RAM the CPU offloads stop fitting, and the reason says so
    p = plan(cfg, gpu_memory_gb=80, host_ram_gb=64, nvme_free_gb=500)
    assert not p.strategies["zero3_offload"].fits and "CPU needs" in p.strategies["zero3_offload"].why
    assert p.strategies["infinity"].fits
    assert p.recommendation == "infinity"


def test_nothing_fits_gives_next_option():
    cfg = RunConfig(model="bloom-7b1", seq_len=2048, micro_batch=64, precision="bf16", gpus=1)
    p = plan(cfg, gpu_memory_gb=8, strategies=("dp", "zero2", "zero3"))
    assert p.recommendation is None
    assert "--gradient-checkpointing" in p.next_option and "more GPUs" in p.next_option


def test_micro_batch_search_is_the_largest_fitting():
    from shardlab.planning.budget import usable
    from shardlab.planning.memory import RESERVED_OVER_ALLOCATED

    cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, precision="bf16", gpus=1)
    p = plan(cfg, gpu_memory_gb=80, strategies=("zero2",))
    m = p.strategies["zero2"].max_micro_batch
    assert m > 8
    for micro, fits in ((m, True), (m + 1, False)):
        q = plan(cfg.model_copy(update={"micro_batch": micro}), gpu_memory_gb=80, strategies=("zero2",))
        assert (q.strategies["zero2"].gpu_peak * RESERVED_OVER_ALLOCATED <= usable(q.gpu_memory)) is fits


def test_zero3_plans_no_reduce_bucket():
    """zero3 without offload defaults to contiguous_gradients off (deepspeed_config.contiguous_gradients): no reduce
    bucket (reduce_bucket_size x 2 B), on one rank or several. gpt2-medium micro 8 on an H100: 17.91 GiB measured
    without the bucket, planned 18.7 with it (benchmarks/results/2026-11-27-h100-zero3-combo/); llama-3.2-1b's two-rank
    code path on one H200: 35.78 GiB measured without, 36.72 with (benchmarks/results/2026-11-29-h200-zero3-two-rank-path/)."""
    bucket = 500_000_000 * 2 / GiB
    for gpus, drop in ((1, bucket), (2, bucket)):
        cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, precision="bf16", gpus=gpus)
        old = cfg.model_copy(update={"strategy_options": cfg.strategy_options.model_copy(update={"contiguous_gradients": True})})
        new_peak, old_peak = (plan(c, gpu_memory_gb=80, strategies=("zero3",)).strategies["zero3"].gpu_peak / GiB for c in (cfg, old))
        assert old_peak - new_peak == pytest.approx(drop, abs=1e-6), gpus


# zero2, seq 1024, micro 8, bf16, synthetic ids, on H200s: torch max_memory_allocated of the busiest rank
# (benchmarks/results/2026-11-28-h200x2-scaling: call 5's llama-eager.md, call 1's table).
MEASURED_ZERO2_H200 = [("llama-3.2-1b", 2, 26.58), ("llama-3.2-1b", 1, 33.48), ("gpt2-large", 2, 28.44)]


@pytest.mark.parametrize("model, gpus, measured", MEASURED_ZERO2_H200)
def test_zero2_reduce_buckets_are_made_by_backward_not_before_it(model, gpus, measured):
    """DeepSpeed 0.19.8 allocates ZeRO-1/2's reduce bucket (two under overlap_comm, on by default with two ranks) in the
    first gradient hook of backward (stage_1_and_2.py process_gradients -> setup_buckets) and frees it at backward's
    end (_release_ipg_buffers): it never meets the logits at the start of backward. Counted there, these cells were
    planned 28.38, 34.35 and 29.75 GiB (+6.8%, +2.6%, +4.6%); the gap was one bucket (0.93 GiB) on one GPU, two on two."""
    cfg = RunConfig(model=model, seq_len=1024, micro_batch=8, precision="bf16", gpus=gpus,
                    dataset={"source": "synthetic", "eval_split": 0.0})
    sp = plan(cfg, gpu_memory_gb=139, strategies=("zero2",)).strategies["zero2"]
    assert sp.gpu_peak / GiB == pytest.approx(measured, rel=0.05)
    off = cfg.model_copy(update={"strategy_options": cfg.strategy_options.model_copy(update={"contiguous_gradients": False})})
    without = plan(off, gpu_memory_gb=139, strategies=("zero2",)).strategies["zero2"]  # no bucket at all
    moment = lambda p, what: next(v for k, v in p.moments.items() if k.startswith(what))  # noqa: E731
    assert moment(sp, "start of backward") == moment(without, "start of backward")
    buckets = (2 if gpus > 1 else 1) * 500_000_000 * 2  # reduce_bucket_size x 2 B, x2 under overlap_comm
    assert moment(sp, "backward at the LM head") - moment(without, "backward at the LM head") == pytest.approx(buckets)


@pytest.mark.parametrize("gpus, measured", [(2, 40.62), (1, 36.01)])
def test_dp_gradients_are_views_of_ddps_buckets(gpus, measured):
    """dp on several ranks wraps the model with DDP(gradient_as_bucket_view=True): its buckets (the gradients' dtype,
    allocated with the wrapper) hold the gradients, so the optimizer step sees no second copy beside them. The peak is
    the start of backward, before any gradient exists, with or without bucket views (the same tensors are alive then):
    llama-3.2-1b micro 8 on H200s (benchmarks/results/2026-11-28-h200x2-scaling, call 5, run with
    gradient_as_bucket_view=False) 40.62 GiB on two GPUs, 36.01 on one (no DDP); planned 40.55 and 35.95 before and
    now. On two GPUs the optimizer step was planned 23.02 GiB (buckets and gradients), now 18.42: not measured."""
    cfg = RunConfig(model="llama-3.2-1b", seq_len=1024, micro_batch=8, precision="bf16", gpus=gpus,
                    dataset={"source": "synthetic", "eval_split": 0.0})
    sp = plan(cfg, gpu_memory_gb=139, strategies=("dp",)).strategies["dp"]
    assert sp.gpu_peak / GiB == pytest.approx(measured, rel=0.05) and sp.peak_moment.startswith("start of backward")
    n = 1_235_814_400
    step = next(v for k, v in sp.moments.items() if k.startswith("optimizer step"))
    assert step == pytest.approx((4 + 8 + 4) * n)  # fp32 weights, AdamW m and v, and the gradients: a bucket or not
    bf16 = plan(cfg.model_copy(update={"master_weights": "bf16", "optimizer": "adamw8bit"}), gpu_memory_gb=139,
                strategies=("dp",)).strategies["dp"]
    assert bf16.gpu["temporary"] == pytest.approx(2 * n if gpus > 1 else 0.0)  # bf16 gradients, bf16 buckets: all it has


def test_fsdp_plans_the_root_units_reduce_scatter_at_the_end_of_backward():
    """FSDP2 on several ranks reduces its last unit, the root (embeddings and tied head), once the activations are gone:
    beside every sharded gradient, the root's unsharded 16-bit gradients and the fp32 reduce-scatter input they are
    copied into. bloom-7b1 (a 1.03B-parameter embedding) on 2 H200s, micro 8, checkpointing: 59.2 GiB measured, 52.7
    planned at the optimizer step before this moment. gpt2-large (a small root, large activations) keeps its peak."""
    cfg = RunConfig(model="bloom-7b1", seq_len=1024, micro_batch=8, precision="bf16", gpus=2, gradient_checkpointing=True)
    p = plan(cfg, gpu_memory_gb=141, strategies=("fsdp",)).strategies["fsdp"]
    assert p.peak_moment.startswith("end of backward (FSDP2's reduce-scatter")
    n, root = 7_069_016_064, 1_027_604_480  # the root: the tied word embeddings (250880 x 4096) + its layernorm
    states = (4 + 4 + 8) * n / 2  # sharded fp32 params, grads, AdamW m and v
    assert p.gpu_peak == pytest.approx(states + 6 * root, rel=0.01)
    assert p.gpu_peak / GiB == pytest.approx(59.2, rel=0.05)
    small = plan(cfg.model_copy(update={"model": "gpt2-large", "gradient_checkpointing": False}), gpu_memory_gb=141,
                 strategies=("fsdp",)).strategies["fsdp"]
    assert small.peak_moment.startswith("start of backward")


# ---- the documented error against the H100 runs --------------------------------------------------------


def test_h100_foundation_errors(capsys):
    """Predicted vs measured peak allocated memory, gpt2-medium, seq 1024, micro 8, bf16, 1 x H100
    (benchmarks/results/h100-foundation-run2/foundation.json). Nothing in planner.py is fitted to these; each
    is within 5% (a change that moves one past it fails here and must say why): dp -0.2%, zero2 +0.2% (+4.8% while its reduce bucket was
    counted at the start of backward: test_zero2_reduce_buckets_are_made_by_backward_not_before_it), zero3 +0.6%,
    zero2_offload +4.7% (-0.9% since the fp32 accumulation buffer), fsdp +0.2% (-0.8% since the root is no longer
    counted gathered during the loss' backward: fsdp.params_gathered_through_backward). dp --compile (micro 16, 23.7 GiB measured with the compiled loss) is NOT
    modelled: the eager prediction is ~40 GiB (+69%), since inductor recomputes instead of saving.
    Those runs computed the loss inside the model (what loss_kernel=hf still does), and fsdp resharded after forward
    (the default then; one rank now defaults to not resharding), and zero3 kept DeepSpeed's contiguous gradient bucket
    (one rank now defaults to none: test_one_rank_zero3_plans_no_reduce_bucket)."""
    cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, precision="bf16", gpus=1, loss_kernel="hf",
                    strategy_options={"fsdp_reshard_after_forward": True, "contiguous_gradients": True})
    p = plan(cfg, gpu_memory_gb=80, strategies=tuple(MEASURED_H100))
    rows = []
    for s, measured in MEASURED_H100.items():
        pred = p.strategies[s].gpu_peak / GiB
        err = pred / measured - 1
        rows.append(f"{s:14s} predicted {pred:6.2f} GiB  measured {measured:6.2f} GiB  error {err:+.1%}")
        assert abs(err) < 0.05, rows[-1]
    with capsys.disabled():
        print("\n" + "\n".join(rows))


def test_report_activation_errors(capsys):
    """The whole table of the estimate's errors (printed with -s), from the same cached measurements as the tests
    above, whatever ran before: every case of both grids measured and within its bound."""
    rows = [(f"{n} ckpt={c} s={s} b={b}", p / m - 1, TINY_BOUND) for n, a, c in TINY_CASES for (s, b), (p, m) in tiny_errors(n, a, c).items()]
    rows += [(f"{f} {d} drop={r} s={s} b={b}", p / m - 1, WIDE_BOUND) for f, d, r in WIDE_CASES for (s, b), (p, m) in wide_errors(f, d, r).items()]
    print("\nactivation errors (predicted / measured - 1):\n" + "\n".join(f"{label}: {err:+.2%}" for label, err, _ in rows))
    assert len(rows) == 4 * len(TINY_CASES) + 2 * len(WIDE_CASES) == 36
    worst = max(rows, key=lambda r: abs(r[1]) / r[2])
    assert abs(worst[1]) < worst[2], worst


# ---- bad inputs and the CLI ------------------------------------------------------------------------------


def test_bad_inputs():
    with pytest.raises(UserError, match="did you mean"):
        plan(RunConfig(model="gpt2-mediun"), gpu_memory_gb=80)
    for bad in (0, -8, float("nan")):
        with pytest.raises(UserError, match="positive"):
            plan(RunConfig(model="tiny-gpt2"), gpu_memory_gb=bad)
    with pytest.raises(UserError, match="positive"):
        plan(RunConfig(model="tiny-gpt2"), gpu_memory_gb=80, host_ram_gb=-1)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--gpu-memory-gb"):
            plan(RunConfig(model="tiny-gpt2"))


def test_cli_errors_are_one_line(capsys):
    assert main(["plan", "--model", "gpt2-mediun", "--gpu-memory-gb", "80"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert main(["plan", "--model", "tiny-gpt2", "--gpus", "0", "--gpu-memory-gb", "80"]) == 2
    assert main(["plan", "--model", "tiny-gpt2", "--gpu-memory-gb", "-5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("error: ") for e in err)


def test_cli_json_and_table(capsys):
    argv = ["plan", "--model", "tiny-gpt2", "--seq-len", "64", "--micro-batch", "2", "--precision", "bf16", "--gpu-memory-gb", "16"]
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["strategies"]) >= {"dp", "zero3", "fsdp", "infinity"}
    assert data["recommendation"] == "dp"
    assert data["strategies"]["zero2"]["paper_bytes_per_param"] == 16
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Recommendation" in out and "ZeRO paper" in out


def test_compiled_loss_keeps_only_16bit_logits_and_their_gradient():
    """shardlab.training.loss on CUDA: the logits' share of the peak drops from 12 to 2*2 bytes per logit (bf16)."""
    from shardlab.training.models import build_hf_config
    from shardlab.planning.arch import arch_from_hf_config

    cfg = RunConfig(model="bloom-560m", seq_len=1024, micro_batch=4, precision="bf16", gpus=1)
    bsv = 4 * 1024 * arch_from_hf_config(build_hf_config(cfg)).vocab
    # eval_blocks=0: training's moments alone (with a full eval batch the eager eval loss' 10 B/logit is this plan's peak)
    got = {k: plan(cfg.model_copy(update={"loss_kernel": k}), gpu_memory_gb=80, strategies=("dp", "zero2"), eval_blocks=0)
           for k in ("hf", "compiled", "auto")}
    for s in ("dp", "zero2"):
        assert got["hf"].strategies[s].gpu["logits (loss)"] == 12 * bsv
        assert got["compiled"].strategies[s].gpu["logits (loss)"] == 4 * bsv
        assert got["auto"].strategies[s].gpu["logits (loss)"] == 4 * bsv  # a GPU plan: auto is compiled
        assert got["hf"].strategies[s].gpu_peak - got["compiled"].strategies[s].gpu_peak == pytest.approx(8 * bsv)


# gpt2-large, seq 1024, bf16: peak allocated measured on GPUs (torch.cuda.max_memory_allocated, the busiest rank).
# zero3 on 2/4 x H200 (micro 4, global 32, transformers' loss): benchmarks/results/2026-11-21-h200x4-pipeline/rows.json;
# zero3_offload on 1 x H100 (micro 2, compiled loss): benchmarks/results/2026-11-21-h100-session3/plan-validation/.
# The offload cells ran with DeepSpeed's default buckets, before offload runs got model-sized ones
# (strategies/deepspeed_config.sized_buckets): set explicitly, as the runs had them.
MEASURED_BUCKETS = dict(reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000,
                        stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000)
MEASURED_ZERO3_GATHER = [
    # measured with contiguous gradients, then the several-rank default
    (dict(model="gpt2-large", gpus=2, micro_batch=4, grad_accum=4, loss_kernel="hf",
          strategy_options={"contiguous_gradients": True}), "zero3", 20.821),
    (dict(model="gpt2-large", gpus=4, micro_batch=4, grad_accum=2, loss_kernel="hf",
          strategy_options={"contiguous_gradients": True}), "zero3", 17.9),
    (dict(model="gpt2-large", gpus=1, micro_batch=2, grad_accum=1, strategy_options=MEASURED_BUCKETS), "zero3_offload", 7.95),
    # measured with BLOOM's eager attention (before shardlab.compat.bloom_sdpa made sdpa its auto choice)
    (dict(model="bloom-560m", gpus=1, micro_batch=2, grad_accum=1, attn_implementation="eager", strategy_options=MEASURED_BUCKETS),
     "zero3_offload", 9.96),
]


@pytest.mark.parametrize("fields, strategy, measured", MEASURED_ZERO3_GATHER)
def test_zero3_keeps_gathered_params_for_reuse_in_backward(fields, strategy, measured):
    """DeepSpeed keeps every gathered parameter reused within stage3_max_reuse_distance (1e9): for these models all of
    them, at the start of backward. With only the largest layer counted these cells were 5-16% under."""
    cfg = RunConfig(seq_len=1024, precision="bf16", **fields)
    sp = plan(cfg, gpu_memory_gb=139, strategies=(strategy,)).strategies[strategy]
    assert sp.gpu_peak / GiB == pytest.approx(measured, rel=0.03)
    n = sp.gpu["temporary"]
    short = plan(cfg.model_copy(update={"strategy_options": cfg.strategy_options.model_copy(update={"stage3_max_reuse_distance": 0})}),
                 gpu_memory_gb=139, strategies=(strategy,)).strategies[strategy]
    assert short.gpu["temporary"] < n and short.gpu_peak / GiB < measured * 0.96  # the reuse distance is what closes the gap


def test_cpu_adamw_step_temporaries_are_per_tensor():
    """On the CPU torch's AdamW takes the single-tensor path: its step holds two temporaries of the tensor it is
    updating, so the plan counts twice the largest tensor (not a model-sized foreach buffer). Checked against the
    allocations torch.profiler records during a real step of tiny-gpt2 (its largest tensor, the tied embedding,
    is 95% of the model, so the old 4 bytes x all parameters was half the truth)."""
    from allocations import peak_allocated
    from torch.profiler import ProfilerActivity, profile

    from shardlab.training.models import build_model
    from shardlab.training.optim import adamw
    from shardlab.planning.strategy_plan import predict_cpu_run

    cfg = RunConfig(model="tiny-gpt2", device="cpu", seq_len=64, micro_batch=2, weight_decay=0.1)
    sp, _ = predict_cpu_run(cfg, 1, reuse_heap=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = adamw(model, cfg, "cpu")
    ids = torch.randint(0, 1000, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the first step allocates the moments
    model(input_ids=ids, labels=ids).loss.backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    peak = peak_allocated(prof)
    largest = max(p.numel() for p in model.parameters()) * 4
    assert peak == pytest.approx(2 * largest, rel=0.02)
    assert sp.gpu["step buffers"] == pytest.approx(peak, rel=0.02)


# ---- FSDP2's reshard_after_forward: automatic on one rank --------------------------------------------------------


@pytest.mark.parametrize("strategy, world, given, expected", [
    ("fsdp", 1, None, False),  # one rank: resharding would only re-gather the whole "shard" in backward
    ("fsdp", 2, None, True),
    ("fsdp", 8, None, True),
    ("fsdp_offload", 1, None, True),  # params on the CPU: keeping them gathered would hold the whole model on the GPU
    ("fsdp", 1, True, True),
    ("fsdp", 2, False, False),
    ("fsdp_offload", 1, False, False),
])
def test_fsdp_reshard_after_forward_resolution(strategy, world, given, expected):
    from shardlab.strategies.fsdp import params_gathered_through_backward, reshard_after_forward

    cfg = RunConfig(strategy=strategy, strategy_options={"fsdp_reshard_after_forward": given})
    assert reshard_after_forward(cfg, world) is expected
    assert params_gathered_through_backward(cfg, world) is (not expected)
    # the planner's form: another strategy planned from the same config decides, not cfg.strategy
    other = "fsdp_offload" if strategy == "fsdp" else "fsdp"
    assert reshard_after_forward(cfg.model_copy(update={"strategy": other}), world, strategy) is expected


def test_plan_keeps_fsdp_params_gathered_on_one_rank_only():
    """Default options: fsdp on one GPU plans every unit's 16-bit params kept from forward to backward (2 B/param in
    bf16); not on 2 GPUs, nor fsdp_offload on one GPU, nor fsdp on one GPU told to reshard."""
    def gathered(gpus, strategy="fsdp", **opts):
        cfg = RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, precision="bf16", gpus=gpus, strategy_options=opts)
        p = plan(cfg, gpu_memory_gb=80, strategies=(strategy,))
        notes = [x for x in p.strategies[strategy].notes if x.startswith("unsharded params kept gathered")]
        assert len(notes) <= 1
        return p, notes

    p, notes = gathered(1)
    label = "unsharded params kept gathered from forward to backward (no reshard after forward)"
    assert notes == [f"{label}: {2 * p.n_params / GiB:.2f} GiB"]  # bf16: 2 B x every parameter
    assert gathered(2)[1] == []
    assert gathered(1, "fsdp_offload")[1] == []
    assert gathered(1, fsdp_reshard_after_forward=True)[1] == []
    assert gathered(2, fsdp_reshard_after_forward=False)[1] != []
    # a full plan (every strategy from one config) decides per planned strategy
    full = plan(RunConfig(model="gpt2-medium", seq_len=1024, micro_batch=8, precision="bf16", gpus=1), gpu_memory_gb=80,
                strategies=("fsdp", "fsdp_offload"))
    kept = {s: any(x.startswith("unsharded params kept gathered") for x in sp.notes) for s, sp in full.strategies.items()}
    assert kept == {"fsdp": True, "fsdp_offload": False}


def test_an_adamw8bit_runs_host_memory_counts_its_compiler_not_autotuner_copies():
    """torchao compiles its 8-bit step in the training process: rank RSS 2.20-2.23 GiB against an eager process's 1.93,
    once the pinned copies of inductor's first-run autotuning are taken out (13B 4.70 - 2.5 released, bloom-7b1
    10.22 - 8.0 and 9.23 - 7.0; benchmarks/results/2026-11-27-h100-remeasure, calls 1 and 4). shardlab autotunes that
    step before training with the clones on the GPU (loop/warm_8bit.py), so the plan no longer adds the copies (it
    bounded them at 10.56 GiB for bloom-7b1, +14.4% at micro 32). Exact AdamW runs compile no optimizer step."""
    from shardlab.planning.planner import plan as make_plan

    def host(model="bloom-7b1", micro=8, **fields):
        cfg = RunConfig(model=model, seq_len=1024, precision="bf16", micro_batch=micro, gradient_checkpointing=True,
                        max_grad_norm=None, loss_kernel="liger", **fields)
        p = make_plan(cfg, gpu_memory_gb=79.2, host_ram_gb=125.9, strategies=("dp",))
        return p.strategies["dp"].cpu_per_node / GiB, " ".join(p.notes)

    eight_bit = dict(optimizer="adamw8bit", optimizer_in_backward=True)
    for model, micro, measured in (("bloom-7b1", 8, 10.22 - 8.0), ("bloom-7b1", 32, 9.23 - 7.0), ("llama-2-13b", 16, 4.70 - 2.5)):
        planned, notes = host(model, micro, master_weights="bf16", **eight_bit)
        assert planned == pytest.approx(measured, rel=0.03), model
        assert "copies nothing to the host" in notes
    exact, notes = host()
    assert exact == pytest.approx(1.93, abs=0.01) and "8-bit" not in notes


def test_compiling_the_8bit_step_before_training_is_a_gpu_moment():
    """shardlab compiles torchao's step before training beside the weights alone (loop/warm_8bit.py): for a small
    batch of a model whose embedding is a third of it (gpt2), that is the GPU's peak; at bloom-7b1's sequences it is not."""
    from shardlab.planning.planner import eight_bit_warmup_bytes, plan as make_plan

    def dp(model, micro, seq_len=64):
        cfg = RunConfig(model=model, seq_len=seq_len, precision="bf16", micro_batch=micro, optimizer="adamw8bit",
                        optimizer_in_backward=True, max_grad_norm=None)
        return make_plan(cfg, gpu_memory_gb=79.2, strategies=("dp",)).strategies["dp"]

    small = dp("gpt2", 1)
    assert small.peak_moment.startswith("compiling the 8-bit step")
    embedding = 50257 * 768
    assert small.gpu_peak == pytest.approx(small.gpu["parameters"] + eight_bit_warmup_bytes(embedding, 4), rel=1e-6)
    assert not dp("bloom-7b1", 8, 1024).peak_moment.startswith("compiling")


def test_plan_shows_where_the_host_ram_goes():
    """The recommended strategy's host buffers and those of every strategy refused for host RAM, one row each, with the
    total: bloom-7b1 on an 80 GB GPU and a 125.9 GiB host recommends fsdp_offload (119.0 GiB) and refuses zero2_offload
    (136.6). A run whose recommendation keeps only the process on the host prints no such table."""
    from rich.console import Console

    from shardlab.planning.planner import plan as make_plan
    from shardlab.planning.render import render

    def text(cfg, gpu, host):
        console = Console(width=200, record=True)
        render(make_plan(cfg, gpu_memory_gb=gpu, host_ram_gb=host), console)
        return console.export_text()

    big = text(RunConfig(model="bloom-7b1", seq_len=1024, precision="bf16", micro_batch=8, global_batch=32,
                         gradient_checkpointing=True), 79.2, 125.9)
    table = big[big.index("Host memory per node"):]
    assert "fits when 1.03 x peak <= 125.9" in table
    assert "fsdp_offload" in table and "AdamW m, v shards" in table and "119.02" in table
    assert "zero2_offload" in table and "fp32 master partition" in table and "136.60" in table
    small = text(RunConfig(model="tiny-gpt2", seq_len=64, micro_batch=2), 80, 64)
    assert "Host memory per node" not in small


@pytest.mark.parametrize("name", strategy_names())
def test_the_run_and_the_plan_take_autocast_from_one_owner(name):
    """Whether forward runs under autocast is training.optim.autocasts' answer, for the run (Strategy.autocast) and the
    plan (its activations' mode) alike: the planner once decided it by engine, and planned ao_offload, which runs under
    autocast, as pure 16-bit (bloom-7b1 micro 16 on one H200: 118.1 GiB planned, 124.1 measured)."""
    from types import SimpleNamespace

    from shardlab.planning.strategy_plan import compute_mode
    from shardlab.strategies.base import Strategy
    from shardlab.specs.registry import spec
    from shardlab.runtime.resolved import resolve_precision

    for precision in ("bf16", "fp32"):
        for master in ("fp32", "bf16"):
            cfg = RunConfig(strategy=name, master_weights=master, precision=precision)
            run = SimpleNamespace(spec=spec(name), cfg=cfg, precision=resolve_precision(precision, "cuda", True),
                                  env=SimpleNamespace(device=torch.device("cpu")))
            runs_autocast = isinstance(Strategy.autocast(run), torch.autocast)
            assert (compute_mode(name, cfg, precision) == "autocast") == runs_autocast, (precision, master)
    # dp, ao_offload and the pipeline's stages autocast over fp32 weights; DeepSpeed and FSDP2 cast the weights themselves
    assert (compute_mode(name, RunConfig(strategy=name), "bf16") == "autocast") == spec(name).uses_autocast
