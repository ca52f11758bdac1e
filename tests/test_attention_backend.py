"""sdpa_backend (training/attention_backend.py) and compile_mode (training/compiling.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

import shardlab
from shardlab.config import RunConfig
from shardlab.errors import UserError
from shardlab.measure import compile_stats
from shardlab.training import attention_backend, compiling


class _Ops(TorchDispatchMode):
    """The aten ops that ran inside it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _attention_ops(choice: str) -> set[str]:
    q = torch.randn(2, 2, 16, 8, requires_grad=True)
    with attention_backend.context(choice), _Ops() as ops:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    return {n for n in ops.names if "attention" in n or n == "bmm"}


def test_the_choice_goes_first_and_the_others_stay_behind_it():
    assert attention_backend.priority("cudnn") == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert attention_backend.priority("efficient")[0] == SDPBackend.EFFICIENT_ATTENTION
    assert attention_backend.priority("math") == [SDPBackend.MATH]  # the reference alone


def test_math_runs_the_unfused_reference_and_auto_leaves_torch_alone():
    """On a CPU torch runs its flash kernel by default; 'math' must replace it (bmm + softmax), fwd and bwd."""
    assert _attention_ops("auto") == {"_scaled_dot_product_flash_attention_for_cpu",
                                      "_scaled_dot_product_flash_attention_for_cpu_backward"}
    math = _attention_ops("math")
    assert "bmm" in math and not any("flash" in n for n in math)
    assert torch._C._get_math_sdp_enabled() and torch._C._get_flash_sdp_enabled()  # restored on exit


def test_cuda_only_backends_are_refused_on_a_cpu_in_one_line():
    for choice in ("cudnn", "efficient"):
        with pytest.raises(UserError, match=f"sdpa_backend '{choice}' needs a CUDA GPU"):
            attention_backend.check(choice, "cpu")
        attention_backend.check(choice, "cuda")
    for choice in ("auto", "flash", "math"):
        attention_backend.check(choice, "cpu")


def test_each_choice_compiles_into_a_cache_of_its_own(tmp_path, monkeypatch):
    """The AOTAutograd cache ignores the SDPA flags: a shared directory would serve a graph traced under another kernel."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert compile_stats.use_persistent_cache("auto") == tmp_path / "inductor"
    assert compile_stats.use_persistent_cache("cudnn") == tmp_path / "inductor" / "sdpa-cudnn"
    assert compile_stats.use_persistent_cache("cudnn") == tmp_path / "inductor" / "sdpa-cudnn"  # a worker inherits it


def test_a_run_with_the_math_kernel_trains_like_the_default_one(tmp_path):
    """dp, tiny-gpt2, fp32, 3 steps in this process: the same losses (1e-5) and the choice in summary.json."""
    losses = {}
    for choice in ("auto", "math"):
        cfg = shardlab.RunConfig(model="tiny-gpt2", device="cpu", dataset={"source": "synthetic", "eval_samples": 1},
                                 seq_len=32, micro_batch=2, max_steps=3, seed=3, precision="fp32", export=False,
                                 eval_at_start=False, sdpa_backend=choice, output_dir=str(tmp_path / choice))
        result = shardlab.train(cfg)
        assert result.summary["sdpa_backend"] == choice
        losses[choice] = result.step_losses
    assert len(losses["math"]) == 3 and losses["math"] == pytest.approx(losses["auto"], rel=1e-5)


def test_compile_mode_reaches_torch_compile(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    model = torch.nn.Linear(2, 2)
    compiling.compile_model(model, RunConfig(compile=True))
    compiling.compile_model(model, RunConfig(compile=True, compile_mode="max-autotune-no-cudagraphs"))
    # dp's and fsdp's whole-model compile (strategies/ddp.py, fsdp.py) take the same path
    compiling.compile_module(model, RunConfig(compile=True, compile_mode="reduce-overhead"))
    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")  # tests' and debugging's backend
    compiling.compile_module(model, RunConfig(compile=True))
    assert seen == [{"backend": "inductor"}, {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
                    {"backend": "inductor", "mode": "reduce-overhead"}, {"backend": "aot_eager"}]
