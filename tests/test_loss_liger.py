"""loss_kernel=liger: the output head fused with the loss (Liger-Kernel), checked on the CPU.

Liger's kernel is Triton code and runs only on a GPU, so the CPU tests check everything around it: the config value,
the preflight refusals (no GPU, liger not importable, strategies that shard the head's weight, models that transform
their logits), and the wiring through a strategy's forward with the plain reference function
(``loss.reference_linear_cross_entropy``: the head's matmul, then fp32 cross-entropy) substituted at the seam the
kernel is loaded through (``loss.fused_linear_cross_entropy``). That wiring must give the model's own loss and
gradients: the labels shifted by one, -100 ignored, the head's gradient reaching a weight tied to the input
embedding, the MoE router term kept, and eval giving the same loss.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from shardlab.config import RunConfig
from shardlab.errors import UserError
from shardlab.runtime.distributed import DistEnv
from shardlab.strategies import strategy_class
from shardlab.specs.registry import all_specs, spec
from shardlab.training import loss
from shardlab.training.models import build_model
from shardlab.runtime.resolved import Precision


@pytest.fixture
def reference_kernel(monkeypatch):
    """The CPU stand-in for Liger's kernel, at the seam HeadFusedLoss and the preflight check load it through."""
    monkeypatch.setattr(loss, "fused_linear_cross_entropy", lambda: loss.reference_linear_cross_entropy)


def _batch(vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 32), generator=g)
    labels = ids.clone()
    labels[0, :7] = loss.IGNORE  # answer-only loss: a prompt
    labels[1, -5:] = loss.IGNORE  # padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


# ---- config and preflight ----------------------------------------------------------------------------------


def test_config_takes_liger_and_names_a_typo():
    assert RunConfig(model="tiny-gpt2", loss_kernel="liger").loss_kernel == "liger"
    with pytest.raises(Exception, match="liger"):  # the allowed values are listed in the message
        RunConfig(model="tiny-gpt2", loss_kernel="ligre")


def test_cpu_run_is_refused_in_preflight_in_one_line_with_nothing_written(tmp_path, capsys, monkeypatch):
    from shardlab.cli import main

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    env_before = dict(os.environ)
    code = main(["train", "--model", "tiny-gpt2", "--device", "cpu", "--max-steps", "1", "--set", "loss_kernel=liger"])
    assert dict(os.environ) == env_before  # what the command set for itself (its start time) is gone
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and "(fix: " in lines[0] and "liger" in lines[0] and "CUDA" in lines[0], err
    assert os.listdir(work) == [], "the refused run wrote files"


@pytest.mark.parametrize("name", [s.name for s in all_specs()])
def test_strategies_that_shard_the_head_are_refused_the_others_pass(name, reference_kernel):
    s = spec(name)
    if s.own_loss or "params" in s.sharded:  # pipeline; fsdp, fsdp_offload, zero3, zero3_offload, infinity
        with pytest.raises(UserError) as e:
            loss.check_loss_kernel("liger", s, "cuda")
        assert name in e.value.message and e.value.hint
    else:  # dp, zero0-2 and their offload twins, ao_offload: the head's weight is a whole tensor on the GPU
        loss.check_loss_kernel("liger", s, "cuda")


def test_liger_not_importable_is_refused_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # any import of it now fails
    with pytest.raises(UserError) as e:
        loss.check_loss_kernel("liger", spec("dp"), "cuda")
    assert "Liger-Kernel" in e.value.message and "pip install" in e.value.hint


def test_a_model_that_transforms_its_logits_is_refused(reference_kernel):
    from types import SimpleNamespace

    with pytest.raises(UserError, match="final_logit_softcapping"):
        loss.check_loss_kernel("liger", spec("dp"), "cuda", SimpleNamespace(final_logit_softcapping=30.0))
    loss.check_loss_kernel("liger", spec("dp"), "cuda", SimpleNamespace(final_logit_softcapping=None, logit_scale=1.0))


def test_other_kernels_need_no_check():
    loss.check_loss_kernel("compiled", spec("fsdp"), "cpu")
    loss.check_loss_kernel("auto", spec("zero3"), "cpu")


# ---- the wiring, with the reference function at the seam ---------------------------------------------------


def _dp(model, kernel: str) -> object:
    cfg = RunConfig(model="tiny-gpt2", device="cpu", precision="fp32", loss_kernel=kernel, lr=1e-2, warmup_steps=0,
                    max_grad_norm=None)
    strategy = strategy_class("dp")(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), Precision("fp32"), 1, 3)
    strategy.setup(model, total_steps=10)
    return strategy


def test_dp_forward_equals_the_models_own_loss_gradients_and_steps(reference_kernel):
    """tiny-gpt2 ties lm_head to wte: the head's share of the gradient must reach the shared weight, or the step
    after it (and the loss that follows) would differ."""
    torch.manual_seed(0)
    base = build_model(RunConfig(model="tiny-gpt2", device="cpu")).eval()  # eval: no dropout, both sides see one network
    hf, fused = _dp(copy.deepcopy(base), "hf"), _dp(copy.deepcopy(base), "liger")
    assert fused.loss_kernel == "liger" and hf.loss_kernel == "hf"
    head = fused.hf_model.get_output_embeddings()
    assert head.weight is fused.hf_model.get_input_embeddings().weight  # still tied
    names = [n for n, _ in fused.hf_model.named_parameters()]
    batch = _batch(base.config.vocab_size)
    for step in range(3):
        want, got = hf.forward(batch), fused.forward(batch)
        assert got.item() == pytest.approx(want.item(), rel=1e-5), step
        hf.backward(want, True)
        fused.backward(got, True)
        grads = {n: p.grad for n, p in hf.hf_model.named_parameters()}
        for n, p in fused.hf_model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
        hf.optimizer_step()
        fused.optimizer_step()
    # names, state dict and the head's own forward are as they were: outside the loss the head gives logits again
    assert [n for n, _ in fused.hf_model.named_parameters()] == names
    assert fused.hf_model.state_dict().keys() == hf.hf_model.state_dict().keys()
    assert isinstance(head, torch.nn.Linear)
    with torch.no_grad():
        logits = fused.hf_model(input_ids=batch["input_ids"]).logits
    assert logits.shape[-1] == base.config.vocab_size
    # eval goes through the same forward under no_grad: the same loss
    with torch.no_grad():
        assert fused.forward(batch).item() == pytest.approx(hf.forward(batch).item(), rel=1e-5)


def test_evaluate_gives_the_same_loss(reference_kernel):
    from shardlab.loop.evaluation import evaluate

    torch.manual_seed(0)
    base = build_model(RunConfig(model="tiny-gpt2", device="cpu"))
    hf, fused = _dp(copy.deepcopy(base), "hf"), _dp(copy.deepcopy(base), "liger")
    batches = [_batch(base.config.vocab_size, seed) for seed in (3, 4)]
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    want, got = evaluate(hf, batches, env), evaluate(fused, batches, env)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert fused.model.training  # evaluate hands the model back in training mode


def test_untied_head_with_bias_and_router_loss(reference_kernel):
    """A model whose head is its own parameter (Mixtral: untied) and whose loss has a router term: the fused path gives
    transformers' loss and the head's gradient; a head bias is passed to the kernel too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.5, max_position_embeddings=64, tie_word_embeddings=False)
    model = MixtralForCausalLM(config).eval()
    head = model.get_output_embeddings()
    assert head.weight is not model.get_input_embeddings().weight
    batch = _batch(128)
    want = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    (want_grad,) = torch.autograd.grad(want, head.weight)
    fused = loss.HeadFusedLoss()
    with loss.head_skipped(head):
        outputs = model(input_ids=batch["input_ids"])
    assert outputs.logits.shape[-1] == 32  # the final hidden states, not logits
    got = loss.model_loss(outputs, batch["labels"], lambda h, labels: fused(h, labels, head), model)
    (got_grad,) = torch.autograd.grad(got, head.weight)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-7)

    head.bias = torch.nn.Parameter(torch.randn(128) * 0.1)  # a head with a bias: F.linear(h, W, b) inside the kernel
    with loss.head_skipped(head):
        hidden = model(input_ids=batch["input_ids"]).logits
    logits = model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(fused(hidden, batch["labels"], head), loss.causal_lm_loss(logits, batch["labels"]), rtol=1e-5, atol=0)


def test_head_skip_is_scoped_and_its_class_reused():
    lin = torch.nn.Linear(4, 6)
    x = torch.randn(2, 4)
    with loss.head_skipped(lin):
        assert lin(x) is x
    assert lin(x).shape == (2, 6) and isinstance(lin, torch.nn.Linear)
    other = torch.nn.Linear(4, 6)
    with loss.head_skipped(other):
        pass
    assert type(other) is type(lin)  # one subclass per head class, not one per call (torch.compile guards on it)
    with pytest.raises(RuntimeError), loss.head_skipped(lin):
        raise RuntimeError("the flag is reset on the way out")
    assert lin(x).shape == (2, 6)


def test_planner_counts_no_logits_for_liger():
    from shardlab.planning.arch import arch_from_hf_config
    from shardlab.planning.planner import activation_bytes
    from shardlab.training.models import build_hf_config

    arch = arch_from_hf_config(build_hf_config(RunConfig(model="bloom-7b1")), name="bloom-7b1")
    compiled = activation_bytes(arch, 8, 1024, "autocast", "cuda", True, "compiled")
    liger = activation_bytes(arch, 8, 1024, "autocast", "cuda", True, "liger")
    bsv = 8 * 1024 * arch.vocab
    vh = arch.vocab * arch.hidden
    assert compiled.logits_peak == 4 * bsv
    # liger, autocast: bf16 hidden-state and head-weight gradients held from forward; inside its forward also the bf16
    # weight copy, the fp32 accumulator and one chunk of bf16 logits (8192 tokens / ceil(V / 8h) = 8 chunks of 1024)
    assert liger.logits_saved == 2 * 8 * 1024 * arch.hidden + 2 * vh
    assert liger.logits_peak == liger.logits_saved + 2 * vh + 4 * vh + 2 * 1024 * arch.vocab
    # at micro 8 about the compiled kernel's 4 bytes per logit; what it holds does not grow with the logits, though:
    m16 = {k: activation_bytes(arch, 16, 1024, "autocast", "cuda", True, k).logits_peak for k in ("liger", "compiled")}
    assert m16["liger"] < 0.6 * m16["compiled"]
    assert liger.logits_saved < 0.6 * compiled.logits_saved  # held to backward: 2 V h + 2 b s h against 2 b s V


def test_under_autocast_the_head_runs_in_16_bits_and_its_fp32_weight_gets_the_gradient(reference_kernel):
    """Inside autocast the hidden states and the head weight are cast once to autocast's dtype before the kernel (as
    autocast would cast them for the head's own linear); the fp32 parameter still receives the gradient."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    hidden = torch.randn(2, 12, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 12))
    seen = []

    def spy(h, w, t, b=None):
        seen.append((h.dtype, w.dtype))
        return loss.reference_linear_cross_entropy(h, w, t, b)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss.HeadFusedLoss(spy)(hidden, labels, head)
        want = loss.causal_lm_loss(head(hidden), labels)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    (g_got,) = torch.autograd.grad(got, head.weight)
    (g_want,) = torch.autograd.grad(want, head.weight)
    assert g_got.dtype == torch.float32 == head.weight.dtype
    assert got.item() == pytest.approx(want.item(), rel=1e-2)  # bf16 operands on both sides
    assert ((g_got - g_want).norm() / g_want.norm()).item() < 2e-2
