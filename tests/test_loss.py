"""shardlab.training.loss: the causal-LM loss outside the model equals transformers' own, eager and compiled."""

import pytest
import torch

from shardlab.training import loss
from shardlab.training.models import build_model


@pytest.fixture(scope="module")
def tiny():
    from shardlab.config import RunConfig

    return build_model(RunConfig(model="tiny-gpt2", device="cpu")).eval()  # eval: no dropout, both passes see the same network


def _batch(vocab: int, pad_tail: int = 0):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 32), generator=g)
    labels = ids.clone()
    labels[0, :7] = loss.IGNORE  # a QA prompt: loss on the answer only
    if pad_tail:
        labels[1, -pad_tail:] = loss.IGNORE  # padding
    return ids, labels


@pytest.mark.parametrize("pad_tail", [0, 5])
def test_equals_the_models_own_loss_and_gradients(tiny, pad_tail):
    ids, labels = _batch(tiny.config.vocab_size, pad_tail)
    tiny.zero_grad()
    hf = tiny(input_ids=ids, labels=labels)
    hf.loss.backward()
    want = {n: p.grad.clone() for n, p in tiny.named_parameters()}
    tiny.zero_grad()
    ours = loss.causal_lm_loss(tiny(input_ids=ids).logits, labels)
    ours.backward()
    assert ours.item() == pytest.approx(hf.loss.item(), rel=1e-5)  # fp32; CPU kernels may split reductions by thread count
    for n, p in tiny.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_compiled_bf16_logits_match_the_fp32_upcast_path():
    """The fused kernel upcasts in registers: same loss and bf16 gradient as HF's materialised fp32 copy."""
    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(2, 48, 500, generator=g)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 500, (2, 48), generator=g)
    labels[1, :10] = loss.IGNORE
    from transformers.loss.loss_utils import ForCausalLMLoss

    want = ForCausalLMLoss(logits, labels, vocab_size=500)
    (want_grad,) = torch.autograd.grad(want, logits)
    compiled = loss.build("compiled", "cpu")
    got = compiled(logits, labels)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-6)  # one bf16 rounding apart at most


def test_auto_is_compiled_on_cuda_only():
    assert loss.resolve_loss_kernel("auto", "cuda") == "compiled"
    assert loss.resolve_loss_kernel("auto", "cpu") == "hf"
    assert loss.resolve_loss_kernel("compiled", "cpu") == "compiled"
    assert loss.resolve_loss_kernel("hf", "cuda") == "hf"
    assert loss.build("auto", "cpu") is None


def test_a_mixture_of_experts_keeps_its_router_loss():
    """transformers adds router_aux_loss_coef x aux_loss to the loss it computes; the loss outside the model must too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.5, max_position_embeddings=64)
    model = MixtralForCausalLM(config).eval()
    ids, labels = _batch(128)
    want = model(input_ids=ids, labels=labels).loss
    outputs = model(input_ids=ids)
    assert outputs.aux_loss is not None and outputs.aux_loss.item() > 0
    got = loss.model_loss(outputs, labels, loss.causal_lm_loss, model)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert got.item() != pytest.approx(loss.causal_lm_loss(outputs.logits, labels).item(), rel=1e-3)  # the term matters here
    from types import SimpleNamespace

    from shardlab.errors import UserError

    with pytest.raises(UserError, match="no coefficient shardlab knows"):  # a model whose coefficient has another name
        loss.model_loss(outputs, labels, loss.causal_lm_loss, SimpleNamespace(config=SimpleNamespace()))


# ---- the eval loss, a chunk of tokens at a time ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 48, 96, 1000])  # one token, uneven chunks, one row, whole batch, more
def test_chunked_eval_loss_equals_the_whole_batch_loss(dtype, chunk_tokens):
    g = torch.Generator().manual_seed(5)
    vocab = 500
    logits = (3 * torch.randn(2, 48, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (2, 48), generator=g)
    labels[0, :11] = loss.IGNORE  # a prompt
    labels[1, -6:] = loss.IGNORE  # padding
    chunk_mib = chunk_tokens * 8 * vocab / 2**20
    assert loss.eval_chunk_tokens(vocab, chunk_mib) == max(1, int(chunk_mib * 2**20 // (8 * vocab)))
    want = loss.causal_lm_loss(logits, labels)
    got = loss.chunked_causal_lm_loss(logits, labels, chunk_mib)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_chunk_size_from_the_byte_budget():
    assert loss.eval_chunk_tokens(250_880, 512) == 267  # BLOOM: 8 B a logit, 512 MiB -> 267 tokens
    assert loss.eval_chunk_tokens(50_257, 512) == 1335
    assert loss.eval_chunk_tokens(10**9, 1) == 1  # never 0 tokens
    assert loss.eval_chunk_tokens(50_257, 0) is None  # 0: the whole batch at once
    logits, labels = torch.randn(1, 4, 9), torch.full((1, 4), loss.IGNORE)
    assert loss.chunked_causal_lm_loss(logits, labels, 0).item() == 0.0  # nothing to predict: 0, not nan (x 0 tokens)


def test_eval_forward_passes_no_labels_and_holds_one_chunk(monkeypatch, tiny):
    """Under no_grad the strategy's forward gives the model no labels (no loss of its own on the whole logits) and
    computes the loss chunk by chunk: never an fp32 copy of more than one chunk's logits."""
    import copy

    from shardlab.config import RunConfig
    from shardlab.runtime.distributed import DistEnv
    from shardlab.strategies import strategy_class
    from shardlab.runtime.resolved import Precision

    cfg = RunConfig(model="tiny-gpt2", device="cpu", precision="fp32", loss_kernel="hf", eval_loss_chunk_mib=1)
    strategy = strategy_class("dp")(cfg, DistEnv(0, 1, 0, torch.device("cpu"), "gloo"), Precision("fp32"), 1, 3)
    strategy.setup(copy.deepcopy(tiny), total_steps=1)
    ids, labels = _batch(tiny.config.vocab_size, 5)
    seen, rows = [], []
    real_forward = strategy.hf_model.forward
    monkeypatch.setattr(strategy.hf_model, "forward", lambda **kw: seen.append("labels" in kw) or real_forward(**kw))
    real_ce = loss.F.cross_entropy
    monkeypatch.setattr(loss.F, "cross_entropy", lambda x, *a, **kw: rows.append(x.shape[0]) or real_ce(x, *a, **kw))
    with torch.no_grad():
        got = strategy.forward({"input_ids": ids, "labels": labels})
    assert seen == [False]
    assert max(rows) == loss.eval_chunk_tokens(tiny.config.vocab_size, 1) < ids.numel() and sum(rows) == ids.numel()
    with torch.no_grad():
        want = tiny(input_ids=ids, labels=labels).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
