"""Models: presets (random init, no download), hub ids, local directories and GGUF files.

A ``--model`` is one of

* a **preset** (``PRESETS``): the exact architecture of a real GPT-2, BLOOM or Llama-family checkpoint, built from its
  config with random weights and a fixed seed, so it works with no network at all;
* a **local directory** written by ``save_pretrained`` (must hold ``config.json``);
* a **GGUF file**, or a hub id whose GGUF a package ships (``gguf_files``);
* a **hub id** (``owner/name``), looked up in the local Hugging Face cache first and fetched online only when the hub
  is reachable and ``HF_HUB_OFFLINE`` is not set (``hub``).

``build_hf_config`` gives the config alone (cheap, no weights) for building the model on the meta device when planning
memory. Tokenizers are ``tokenizing``'s.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from . import gguf_files, hub, sdpa_causal
from .. import compat
from ..compat.bloom_sdpa import is_bloom, use_sdpa_attention
from .init_by_module import initialising
from ..measure.mfu import full_numel
from ..config import RunConfig
from ..errors import UserError
from .presets import GPT2_BPE, PRESETS, SMOLLM2_GGUF, Preset, resolve_preset

# Lazy imports below: optional or rarely needed backends (flash_attn's probe, safetensors) and transformers submodules
# that transformers itself loads lazily, each only when its path runs.

__all__ = [
    "Preset",
    "PRESETS",
    "GPT2_BPE",
    "SMOLLM2_GGUF",
    "describe_weights",
    "resolve_preset",
    "build_hf_config",
    "build_model",
    "model_summary",
    "max_positions",
    "resolve_attn_implementation",
    "check_seq_len",
    "is_checkpointing",
    "meta_loadable",
    "init_weights",
    "load_local_weights",
]

def describe_weights(cfg: RunConfig) -> str:
    """Where ``cfg.model``'s weights come from, for the run log."""
    kind, obj = hub.classify(cfg.model)
    if kind == "preset":
        return f"random init (seed {cfg.seed}) in the architecture of {obj.hub_id or 'preset ' + obj.name}, no download"
    if kind == "dir":
        return f"pretrained, from the directory {str(obj)!r}"
    if kind == "gguf":
        via = f" ({cfg.model} is not in the HF cache; the file ships with the {gguf_files.GGUF_PACKAGES[cfg.model].package} package)" \
            if cfg.model in gguf_files.GGUF_PACKAGES else ""
        return f"pretrained, dequantised from the GGUF {str(obj)!r}{via}: {gguf_files.gguf_summary(obj)}"
    return f"pretrained, {obj} from the Hugging Face cache or hub"




# --------------------------------------------------------------------------------------------------
# Configs


def max_positions(hf_config: Any) -> int | None:
    """The longest sequence the architecture accepts, or None when unbounded (ALiBi: BLOOM)."""
    if getattr(hf_config, "model_type", None) == "bloom" or getattr(hf_config, "alibi", False):
        return None
    for attr in ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(cfg: RunConfig, hf_config: Any) -> None:
    n = max_positions(hf_config)
    if n is not None and cfg.seq_len > n:
        raise UserError(f"seq_len {cfg.seq_len} exceeds {cfg.model}'s maximum of {n} positions", f"use --seq-len {n} or less")


def _preset_config(preset: Preset) -> transformers.PretrainedConfig:
    cls = {"gpt2": GPT2Config, "bloom": BloomConfig, "llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[
        preset.family
    ]
    return cls(**dict(preset.config))


def build_hf_config(cfg: RunConfig) -> transformers.PretrainedConfig:
    """The HF config of ``cfg.model`` (no weights); checks ``cfg.seq_len`` against it.

    Build the skeleton for memory planning with
    ``with torch.device("meta"): AutoModelForCausalLM.from_config(config)``.
    """
    kind, obj = hub.classify(cfg.model)
    if kind == "preset":
        hf_config = _preset_config(obj)
    elif kind == "dir":
        if not (obj / "config.json").is_file():
            raise UserError(
                f"model directory {cfg.model!r} has no config.json",
                "point --model at a directory written by save_pretrained, a hub id or a preset",
            )
        try:
            hf_config = AutoConfig.from_pretrained(str(obj), trust_remote_code=cfg.trust_remote_code)
        except ValueError as exc:
            if "trust_remote_code" in str(exc):
                raise hub.remote_code_error(cfg.model) from None
            raise UserError(f"cannot read the config in {cfg.model!r}: {exc}".split("\n")[0], "check its config.json") from None
    elif kind == "gguf":
        hf_config = AutoConfig.from_pretrained(str(gguf_files.gguf_cache(obj, "config")))
    else:
        hf_config = hub.hub_load(AutoConfig.from_pretrained, obj, "model", trust_remote_code=cfg.trust_remote_code)
    check_seq_len(cfg, hf_config)
    return hf_config


# --------------------------------------------------------------------------------------------------
# Attention


@functools.lru_cache(maxsize=1)
def _flash_attn_importable() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:  # installed but broken (ABI mismatch with torch, no CUDA...)
        return False
    return True


def causal_lm_class(hf_config: Any) -> type | None:
    """The transformers class AutoModelForCausalLM would build, or None (remote code, unknown)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except Exception:
        return None


def supports_attention(model_class: type | None, impl: str) -> bool:
    if model_class is None or impl == "eager":
        return True
    if impl == "sdpa":  # BLOOM: through shardlab's ALiBi-bias SDPA attention (compat/bloom_sdpa.py), where it may apply
        return bool(getattr(model_class, "_supports_sdpa", False)) or (is_bloom(model_class) and compat.enabled("bloom_sdpa"))
    if impl == "flash_attention_2":  # transformers 5 spells it _supports_flash_attn, 4.x _supports_flash_attn_2
        return bool(getattr(model_class, "_supports_flash_attn", False) or getattr(model_class, "_supports_flash_attn_2", False))
    return False


def resolve_attn_implementation(requested: str, device_type: str, model_class: type | None = None) -> str:
    """The ``attn_implementation`` to pass to transformers.

    'auto' -> 'flash_attention_2' when ``flash_attn`` imports, the device is CUDA and the model
    supports it; else 'sdpa' (or 'eager' for models without SDPA support). BLOOM's 'sdpa' is
    shardlab's own (compat/bloom_sdpa.py): transformers builds it eager and ``build_model`` patches it.
    An explicit choice the environment or model cannot honour is a UserError.
    """
    name = model_class.__name__ if model_class is not None else "this model"
    if requested == "auto":
        if device_type == "cuda" and _flash_attn_importable() and supports_attention(model_class, "flash_attention_2"):
            return "flash_attention_2"
        return "sdpa" if supports_attention(model_class, "sdpa") else "eager"
    if requested == "flash_attention_2":
        if not _flash_attn_importable():
            raise UserError(
                "attn_implementation flash_attention_2 needs the flash_attn package, which is not installed (or does not import)",
                "`pip install flash-attn --no-build-isolation` on the GPU machine, or use --attn-implementation auto (sdpa)",
            )
        if device_type != "cuda":
            raise UserError("attn_implementation flash_attention_2 needs a CUDA GPU", "use --attn-implementation auto or sdpa")
        if not supports_attention(model_class, requested):
            raise UserError(f"{name} does not support flash_attention_2", "use --attn-implementation auto")
        return requested
    if requested == "sdpa":
        if not supports_attention(model_class, requested):
            raise UserError(f"{name} does not support sdpa attention", "use --attn-implementation auto (eager for this model)")
        return requested
    if requested == "eager":
        return requested
    raise UserError(f"unknown attn_implementation {requested!r}", "use auto, sdpa, eager or flash_attention_2")


def _device_type(cfg: RunConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


# --------------------------------------------------------------------------------------------------
# Models


def build_model(  # noqa: C901 - one branch per way a model is built (preset, hub, GGUF, meta, init); to split
    cfg: RunConfig, *, dtype: torch.dtype = torch.float32, device_type: str | None = None, meta: bool = False
) -> transformers.PreTrainedModel:
    """The causal LM for ``cfg`` on the CPU in ``dtype`` (presets: random init seeded by ``cfg.seed``).

    ``device_type`` ('cuda'/'cpu') only steers the attention choice; default from ``cfg.device``.
    ``meta``: the skeleton on the meta device, no weights (a preset or a local directory only): the caller
    materialises what it keeps (``init_weights``) and loads a directory's files (``load_local_weights``).
    Under a live ``transformers.integrations.HfDeepSpeedConfig`` of ZeRO-3, transformers builds and loads
    inside ``deepspeed.zero.Init``: each parameter is partitioned as it is created.
    """
    hf_config = build_hf_config(cfg)  # validates the name, directory and seq_len first
    kind, obj = hub.classify(cfg.model)
    model_class = causal_lm_class(hf_config)
    attn = resolve_attn_implementation(cfg.attn_implementation, device_type or _device_type(cfg), model_class)
    if model_class is None and cfg.attn_implementation == "auto" and attn == "sdpa":
        attn = None  # remote/unknown class: let transformers pick its best supported implementation
    bloom_sdpa = attn == "sdpa" and is_bloom(model_class)
    if bloom_sdpa:
        attn = "eager"  # transformers refuses sdpa for BLOOM; its attention modules are patched below
    if meta:
        if kind == "hub":
            raise ValueError("meta builds are for presets and local directories (see meta_loadable)")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
            )
    elif kind == "preset":
        # Construction draws nothing; then one seeded init. This is the order of draws that DeepSpeed's zero.Init
        # build and FSDP2's meta build follow too, so every strategy starts from the same weights.
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn)
        torch.manual_seed(cfg.seed)
        init_weights(model)
    else:
        kwargs: dict[str, Any] = dict(
            config=hf_config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
        )
        if kind == "gguf":  # dequantised once to fp32 and kept, then read like a save_pretrained directory
            cached = gguf_files.gguf_weights_cached(obj)
            if cached is not None:
                model = AutoModelForCausalLM.from_pretrained(str(cached), **kwargs)
            else:
                model = gguf_files.dequantise(obj, **kwargs)
        elif kind == "dir":
            try:
                model = AutoModelForCausalLM.from_pretrained(str(obj), **kwargs)
            except OSError as exc:
                raise UserError(
                    f"cannot load the weights in {cfg.model!r}: {str(exc).splitlines()[0]}",
                    "point --model at a complete save_pretrained directory (config.json and *.safetensors)",
                ) from None
        else:
            model = hub.hub_load(AutoModelForCausalLM.from_pretrained, obj, "model", **kwargs)
    if bloom_sdpa:
        use_sdpa_attention(model)
    elif attn == "sdpa":  # SDPA's is_causal kernels also under torch.compile (sdpa_causal.py)
        sdpa_causal.use(model)
    if cfg.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise UserError(f"{type(model).__name__} does not support gradient checkpointing", "drop --gradient-checkpointing")
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if getattr(model, "loss_type", "") is None:
        # GPT2LMHeadModel/BloomForCausalLM get no loss_type and transformers warns before falling back
        # to the causal-LM loss; name that default so the log stays clean.
        model.loss_type = "ForCausalLM"
    return model


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def meta_loadable(cfg: RunConfig) -> bool:
    """Whether ``build_model(meta=True)`` + ``init_weights`` (+ ``load_local_weights``) can stand for the
    ordinary build: a preset, or a local directory whose safetensors files name exactly the model's
    parameters (older checkpoints with other key names go through transformers' own renaming instead)."""
    kind, obj = hub.classify(cfg.model)
    if kind == "preset":
        return True
    if kind != "dir" or not _weight_files(obj) or cfg.peft.method:  # (a directory's names are not an adapted model's)
        return False
    from safetensors import safe_open

    keys: set[str] = set()
    for f in _weight_files(obj):
        with safe_open(str(f), framework="pt") as handle:  # reads the header only
            keys.update(handle.keys())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(build_hf_config(cfg), trust_remote_code=cfg.trust_remote_code)
    wanted = set(skeleton.state_dict().keys())
    tied = {k for k in wanted if k not in keys and _tied_away(skeleton, k)}
    return keys <= wanted and wanted - tied <= keys


def _tied_away(model: torch.nn.Module, key: str) -> bool:
    """``key`` is the output embedding tied to the input one (save_pretrained writes it once)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return out is not None and inp is not None and out.weight is inp.weight and key.endswith("weight") and \
        key.rsplit(".", 1)[0] == next((n for n, m in model.named_modules() if m is out), None)


def init_weights(model: transformers.PreTrainedModel) -> None:
    """transformers' own initialisation of a model materialised from the meta device (``to_empty``),
    in place, on whatever its tensors are now (FSDP2's DTensor shards included). ``init_by_module`` draws the
    same numbers one module at a time. (A model with adapters: pass its adapters.base_only, so that the walk draws the
    base model's numbers, as without adapters; the adapters get theirs from adapters.initialise.)"""
    with initialising(model):
        model.init_weights()


def load_local_weights(model: torch.nn.Module, cfg: RunConfig, load: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load ``cfg.model``'s safetensors files one at a time through ``load(tensors)`` (which copies them
    into the model's own storage, e.g. its shards), so at most one file is held besides the model.
    Nothing to load for a preset (random init)."""
    from safetensors.torch import load_file

    kind, directory = hub.classify(cfg.model)
    if kind != "dir":
        return
    for f in _weight_files(directory):
        tensors = load_file(str(f))
        load(tensors)
        del tensors


def apply_dropout(model: torch.nn.Module, p: float | None) -> None:
    """``--dropout``: one probability for every dropout module and the config's dropout fields; None keeps the model's own."""
    if p is None:
        return
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
    for attr in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, p)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks: the ModuleList that holds most parameters (GPT-2 `h`, BLOOM `h`, Llama `layers`).

    The one block finder: FSDP wraps each as a unit (strategies/fsdp.py), the planner sizes them
    (planning/arch.arch_from_hf_config). The pipeline needs more than the blocks (embeddings, final norm,
    head, per family) and names them itself (strategies/pipeline.model_parts)."""
    best: torch.nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            if best is None or sum(p.numel() for p in module.parameters()) > sum(p.numel() for p in best.parameters()):
                best = module
    return list(best) if best is not None else []


def block_params(blocks: list[torch.nn.Module]) -> int:
    """Parameters of the largest of ``blocks``: what the planner sizes a block by (planning/arch.py) and FSDP2 fills its
    units by (strategies/fsdp.blocks_per_unit), so that the two count alike."""
    return max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, across transformers versions."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


_DTYPE_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def _human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}K"
    return str(n)


def model_summary(model: torch.nn.Module) -> dict[str, Any]:
    """Parameter counts (tied weights once; DeepSpeed ZeRO-3 partitions by their full size) and bytes."""
    seen: set[int] = set()
    n_params = trainable = param_bytes = 0
    by_dtype: Counter[torch.dtype | str] = Counter()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel = full_numel(p)
        n_params += numel
        if p.requires_grad:
            trainable += numel
        # bytes as stored: a 4-bit weight's packed bytes, a ZeRO-3 partition's full size
        param_bytes += (p.numel() if hasattr(p, "quant_state") else numel) * p.element_size()
        by_dtype["4-bit" if hasattr(p, "quant_state") else p.dtype] += numel
    if not by_dtype:
        dtype_name = "none"
    elif len(by_dtype) == 1:
        only = next(iter(by_dtype))
        dtype_name = _DTYPE_SHORT.get(only, str(only).replace("torch.", ""))
    else:
        dtype_name = "mixed" + (" (linear layers 4-bit)" if "4-bit" in by_dtype else "")
    human = f"{_human_count(n_params)} params, {param_bytes / 2**30:.2f} GiB in {dtype_name}"
    if trainable != n_params:
        human += " (frozen)" if trainable == 0 else f" ({_human_count(trainable)} trainable)"
    return {
        "n_params": n_params,
        "trainable": trainable,
        "param_bytes": param_bytes,
        "dtype": dtype_name,
        "n_params_human": _human_count(n_params),
        "human": human,
    }


