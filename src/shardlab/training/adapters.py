"""`--peft lora` and `--peft qlora`: low-rank adapters through the peft library, on a frozen base model.

    base model (as the strategy builds it; qlora: its linear layers quantised to 4-bit NF4 by ``build_quantised``)
      -> ``apply``: peft's ``get_peft_model`` with a ``LoraConfig`` from ``cfg.peft``; every base weight frozen
      -> the strategy wraps it (DDP, DeepSpeed, FSDP2): only the adapters reach the optimizer, so the frozen weights get
         no gradients and no optimizer states
      -> checkpoints hold the adapters and their optimizer states only (the base is rebuilt from the same source)
      -> the export writes peft's adapter directory (``save_pretrained``), or with ``shardlab export --merge`` the
         merged model (``merge_and_unload``)

Adapter weights are drawn by shardlab, not by peft (``initialise``): from their own generator seeded with the run's
seed, on the CPU, in the order of their names, then copied into whatever holds them (a plain tensor, an FSDP2 shard).
So every strategy starts from the same adapters, also when the model is a meta skeleton that the strategy
materialises later, and peft's draws leave the run's random streams (dropout, data order) untouched.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..config import RunConfig
from ..errors import UserError

# Lazy imports below: peft and bitsandbytes load only in runs with --peft (peft imports accelerate; bitsandbytes looks
# for its native libraries).

ADAPTER = "default"  # peft's name for the one adapter a run trains
BASE_FILE = "shardlab_base.json"  # in an exported adapter directory: how to rebuild the base model it adapts
PEFT_HINT = "pip install -e . again (peft is one of shardlab's dependencies), or pip install 'peft>=0.21.2,<0.22'"
BNB_HINT = "pip install 'shardlab[adapters]' (bitsandbytes)"


def _peft():
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        bitsandbytes()  # peft imports it when installed: quietly first (see there)
    try:
        import peft
    except ImportError:
        raise UserError("--peft needs the peft library, which is not installed", PEFT_HINT) from None
    return peft


def check(cfg: RunConfig, spec, device_type: str) -> None:
    """One-line refusals of --peft settings for the strategy of ``spec``, before any worker starts
    (Strategy.check_options)."""
    method, adapters, strategy = cfg.peft.method, spec.adapters, spec.name
    if method is None:
        return
    if method not in adapters:
        fix = "use --strategy dp" if method == "qlora" else "use --strategy dp, a zero* strategy or fsdp"
        why = {"pipelining": "its stages are cut from the model by module names, which peft's wrapping changes",
               "torchao": "an adapter's optimizer states are a few MB: there is nothing worth offloading",
               }.get(spec.engine, "not supported there yet")
        if method == "qlora" and "lora" in adapters:
            why = ("its engine would cast or shard the 4-bit layers' packed bytes and lose their quantisation "
                   "state")
        raise UserError(f"--peft {method} is not supported with strategy {strategy!r} ({why})", fix)
    _peft()
    if method == "qlora":
        bitsandbytes()
    if cfg.master_weights == "bf16":  # not tried with adapters: it would also make them bf16
        raise UserError("--master-weights bf16 with --peft is not supported yet",
                        "drop --master-weights bf16 (--peft qlora stores the frozen base in 4 bits instead)")
    if spec.zero_stage == 3 and cfg.strategy_options.zero3_block_leaves:
        raise UserError("strategy_options.zero3_block_leaves with --peft is not supported (DeepSpeed left an adapter "
                        "partitioned in backward)", "drop zero3_block_leaves: with --peft it is off")
    if cfg.compile and method == "qlora":
        raise UserError("--compile with --peft qlora is not supported (torch.compile does not trace bitsandbytes' "
                        "4-bit layers)", "drop --compile, or use --peft lora")


def bitsandbytes():
    """bitsandbytes, or a one-line error naming the extra that installs it."""
    from .optim import quiet_import

    # bitsandbytes 0.50 logs that it could not load optional CPU kernels from the `kernels` hub package on CPU
    # machines; its own torch fallback runs instead (what the CPU tests train with), so the line is noise.
    return quiet_import("bitsandbytes", ("bitsandbytes",), "--peft qlora needs bitsandbytes, which is not installed", BNB_HINT)


def lora_config(cfg: RunConfig):
    """peft's LoraConfig for ``cfg.peft``: adapters in the layers it names, everything else frozen.
    ``init_lora_weights=False``: ``initialise`` draws them instead."""
    p = cfg.peft
    return _peft().LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=p.target_modules,
                              bias="none", task_type="CAUSAL_LM", init_lora_weights=False)


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (cheap: no peft import for the others)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """``model`` with peft's adapters injected (a PeftModel) and every base weight frozen. A model on the meta device
    gets its adapter values when the strategy materialises it (``initialise``)."""
    peft = _peft()
    if cfg.peft.method == "qlora":
        model.is_loaded_in_4bit = True  # peft's LoRA picks its bitsandbytes layer by this flag
    # peft builds each adapter with nn.Linear, which draws from the global generator: isolated, so that the run's
    # later draws (dropout masks) are the same with or without adapters and whatever the strategy
    with torch.random.fork_rng(devices=[]):
        try:
            wrapped = peft.get_peft_model(model, lora_config(cfg))
        except ValueError as err:  # target modules that match nothing, or a layer type LoRA cannot adapt
            raise UserError(f"peft cannot add adapters to {cfg.model}: {str(err).splitlines()[0]}",
                            "set peft.target_modules to names of the model's linear layers (or 'all-linear')") from None
    wrapped.peft_config[ADAPTER].base_model_name_or_path = cfg.model
    if not any(p.is_meta for p in wrapped.parameters()):
        initialise(wrapped, cfg.seed)
    return wrapped


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters, in the order of their names (peft's lora_A / lora_B of every adapted layer)."""
    return sorted(((n, p) for n, p in model.named_parameters() if ".lora_" in n), key=lambda item: item[0])


def initialise(model: nn.Module, seed: int) -> None:
    """Draw every adapter as peft's default does (A: nn.Linear's kaiming-uniform, B: zeros, so the adapted model starts
    as the base model), from a generator of its own seeded with ``seed``, on the CPU, in the order of the adapters'
    names; each value is copied into the parameter's own storage (an FSDP2 shard keeps its slice). No-op for a model
    without adapters."""
    if not is_adapted(model):
        return
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapter_parameters(model):
            full = torch.zeros(tuple(param.shape), dtype=torch.float32)
            if ".lora_A." in name:
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            _copy_into(param, full)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):  # every rank drew the same full tensor: each keeps its slice, no scatter
        full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full.to(device=param.device, dtype=param.dtype))


@contextlib.contextmanager
def base_only(model: nn.Module) -> Iterator[nn.Module]:
    """The transformers model inside ``model`` with every adapted layer put back as its base layer, until the block
    ends: its module tree and names are the base model's, so transformers' initialisation walks (and draws for) the
    very modules of a model without adapters, and a base checkpoint's names address it. ``model`` itself when it has
    no adapters."""
    if not is_adapted(model):
        yield model
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    inner = model.get_base_model()
    swapped = []
    for name, module in list(inner.named_modules()):
        if isinstance(module, BaseTunerLayer) and name:
            parent_name, _, child = name.rpartition(".")
            parent = inner.get_submodule(parent_name)
            parent._modules[child] = module.get_base_layer()
            swapped.append((parent, child, module))
    try:
        yield inner
    finally:
        for parent, child, module in swapped:
            parent._modules[child] = module


def base_name(name: str) -> str:
    """A peft model's parameter name as the base model names it: 'base_model.model.h.0.attn.c_attn.base_layer.weight'
    -> 'h.0.attn.c_attn.weight'."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


# ---- what the run says and records ---------------------------------------------------------------------------------


def targets(model: nn.Module) -> list[str]:
    """The distinct layer names (last name component) that carry adapters: ['c_attn', 'c_fc', 'c_proj']."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    inner = model.get_base_model()
    return sorted({name.rsplit(".", 1)[-1] for name, m in inner.named_modules() if isinstance(m, BaseTunerLayer)})


def summary(model: nn.Module, cfg: RunConfig) -> dict[str, Any]:
    """summary.json's ``adapter``: the settings, the layers adapted and the parameter counts."""
    from .models import model_summary

    counts = model_summary(model)
    p = cfg.peft
    return {"method": p.method, "r": p.r, "alpha": p.alpha, "dropout": p.dropout,
            "target_modules": p.target_modules, "adapted_layers": targets(model),
            "base_weights": "4-bit NF4 (bitsandbytes), frozen" if p.method == "qlora" else "frozen",
            "trainable_params": counts["trainable"], "total_params": counts["n_params"],
            "trainable_fraction": counts["trainable"] / counts["n_params"] if counts["n_params"] else None}


def describe(info: dict[str, Any]) -> str:
    """One log line from ``summary``'s record."""
    base = "on a 4-bit NF4 base" if info["method"] == "qlora" else "on a frozen base"
    return (f"adapters: {info['method']} r {info['r']}, alpha {info['alpha']:g}, dropout {info['dropout']:g} in "
            f"{', '.join(info['adapted_layers'])} ({info['target_modules'] if isinstance(info['target_modules'], str) else 'named'}) "
            f"{base}: {info['trainable_params']:,} trainable of {info['total_params']:,} parameters "
            f"({info['trainable_fraction']:.2%})")


def layout(cfg: RunConfig, device_type: str, precision: str) -> dict[str, Any] | None:
    """What a checkpoint of adapters only must be resumed (and exported) with, as it holds no base weights
    (reshard.layout): the adapter settings and what rebuilds the same base: the model, the seed and, for a random-init
    preset, the device type it is drawn on (a GPU's generator draws other numbers than the CPU's); for qlora the
    compute dtype its weights were quantised from. None for full fine-tuning."""
    if cfg.peft.method is None:
        return None
    from .models import resolve_preset

    p = cfg.peft
    drawn = resolve_preset(cfg.model) is not None  # a pretrained base does not depend on the seed
    return {"method": p.method, "r": p.r, "alpha": p.alpha, "dropout": p.dropout, "target_modules": p.target_modules,
            "model": cfg.model, "seed": cfg.seed if drawn else None, "base_drawn_on": device_type if drawn else None,
            "compute_dtype": precision if p.method == "qlora" else None}


# ---- QLoRA: the base model's linear layers in 4-bit NF4 -----------------------------------------------------------


def quantised_layers(model: nn.Module) -> list[str]:
    """The names of the layers QLoRA stores in 4 bits: every linear layer (nn.Linear, GPT-2's Conv1D) but the output
    head, as transformers' bitsandbytes loading leaves the head (and a head tied to the embedding) unquantised."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and m is not head]


def four_bit_linear(weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, compute_dtype: torch.dtype,
                    device: torch.device) -> nn.Module:
    """A bitsandbytes Linear4bit holding ``weight`` (out x in; a Conv1D's in x out when ``transposed``) quantised to NF4
    on ``device``, with double quantisation of the block scales (the QLoRA recipe). The packed bytes are stored in
    ``compute_dtype`` elements (bnb_4bit_quant_storage), so that engines which shard by dtype could treat them like
    the other weights."""
    bnb = bitsandbytes()
    w = weight.detach().t() if transposed else weight.detach()
    out_features, in_features = w.shape
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                              compress_statistics=True, quant_type="nf4", quant_storage=compute_dtype, device="meta")
    # quantised from the compute dtype, as transformers' bitsandbytes loading does: the block scales are kept in it
    layer.weight = bnb.nn.Params4bit(w.to(compute_dtype).contiguous(), requires_grad=False,
                                     compress_statistics=True, quant_type="nf4", quant_storage=compute_dtype)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(device), requires_grad=False)
    # On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a layer's weight in place the first time it runs in eval mode
    # without gradients (an inference format computed in bf16): the eval before training would change the weights the
    # steps after it train against. Off: eval and training compute alike.
    layer.support_avx512bf16_for_cpu = False
    return layer.to(device)  # the move quantises (Params4bit.to)


def quantise(model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``model`` (real weights, on any device) with every ``quantised_layers`` layer replaced in place by its 4-bit
    twin on ``device``, one layer at a time, and the rest moved to ``device``."""
    from transformers.pytorch_utils import Conv1D

    for name in quantised_layers(model):
        old = model.get_submodule(name)
        _replace(model, name, four_bit_linear(old.weight, old.bias, isinstance(old, Conv1D), compute_dtype, device))
        del old
    model.requires_grad_(False)  # a frozen base, as build_quantised gives it
    model.is_loaded_in_4bit = True
    # the rest (embedding, head, norms) in the compute dtype, as build_quantised keeps it; a no-op cast for the packed
    # bytes, which four_bit_linear stores in compute_dtype elements
    return model.to(device=device, dtype=compute_dtype)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def build_quantised(cfg: RunConfig, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    """The base model of a qlora run on ``device``: its ``quantised_layers`` in 4-bit NF4, everything else (embedding,
    head, norms: frozen too) in ``compute_dtype``, as a frozen weight needs no fp32 master (llama-2-7b: 0.5 GiB less
    than an fp32 embedding and head).

    A preset (random init) is drawn module by module (init_by_module: the ordinary build's draws, on ``device``),
    each linear layer quantised as soon as its weight is complete: no more than one module is ever held in full
    precision, so a 70B architecture builds in its 4-bit size. Other models load as usual on the CPU and are quantised
    layer by layer as they are moved to ``device``."""
    from transformers.pytorch_utils import Conv1D

    from .init_by_module import init_by_module
    from .models import build_model, resolve_preset

    if resolve_preset(cfg.model) is None:
        return quantise(build_model(cfg, dtype=torch.float32), compute_dtype, device)
    skeleton = build_model(cfg, dtype=torch.float32, meta=True)  # what init_by_module walks
    model = build_model(cfg, dtype=torch.float32, meta=True)  # what receives the weights
    layers = set(quantised_layers(model))
    transposed = {name for name in layers if isinstance(model.get_submodule(name), Conv1D)}

    def emit(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in params.items():
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner)
                if owner in layers and attr == "weight":
                    bias = module.bias if module.bias is not None and not module.bias.is_meta else None
                    new = four_bit_linear(value, bias, owner in transposed, compute_dtype, device)
                    if module.bias is not None and bias is None:  # its bias comes later, by its own name
                        new.bias = nn.Parameter(torch.empty(module.bias.shape, device="meta"), requires_grad=False)
                    _replace(model, owner, new)
                else:  # (drawn in fp32, as the ordinary build draws them, then rounded)
                    module._parameters[attr] = nn.Parameter(value.to(device, compute_dtype), requires_grad=False)
            for name, value in buffers.items():
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._buffers[attr] = value.to(device)

    torch.manual_seed(cfg.seed)
    init_by_module(skeleton, device, emit)
    model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the 4-bit build left {left[:3]} on the meta device")
    model.is_loaded_in_4bit = True
    return model


def dequantised(model: nn.Module, skeleton: nn.Module) -> nn.Module:
    """``model`` with every bitsandbytes 4-bit layer replaced by the layer ``skeleton`` (the same model unquantised, on
    meta) has there, holding the dequantised weights in fp32 on the CPU: the values the run trained against, as a plain
    transformers model that can be merged with its adapters and saved (GPT-2's Conv1D layers get their own layout
    back)."""
    from transformers.pytorch_utils import Conv1D

    bnb = bitsandbytes()
    for name, module in list(model.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit):
            w = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float().cpu()
            plain = type(skeleton.get_submodule(name))
            layer = Conv1D(w.shape[0], w.shape[1]) if plain is Conv1D else nn.Linear(w.shape[1], w.shape[0], bias=module.bias is not None)
            layer.weight = nn.Parameter(w.t().contiguous() if plain is Conv1D else w, requires_grad=False)
            if module.bias is not None:
                layer.bias = nn.Parameter(module.bias.detach().float().cpu(), requires_grad=False)
            _replace(model, name, layer)
    model.is_loaded_in_4bit = False
    return model.to("cpu").float()  # the rest as the run held it (compute dtype), widened


def rebuild_base(cfg: RunConfig, saved: dict[str, Any]) -> nn.Module:
    """The base model an adapter was trained on, on the CPU in fp32, rebuilt from ``saved`` (``layout``'s record): a
    preset drawn from its seed on the device type it was drawn on (one GPU of this machine for a run on GPUs); a qlora
    base quantised to NF4 from its compute dtype as the run did, then dequantised (the weights the adapter learnt
    against)."""
    from .models import build_model, init_weights

    cfg = cfg.model_copy(update={"model": saved["model"], "seed": cfg.seed if saved.get("seed") is None else saved["seed"]})
    device = torch.device(saved.get("base_drawn_on") or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"the base of this adapter is {cfg.model} drawn from seed {cfg.seed} on a GPU (a random-init "
                        "preset: a GPU's generator draws other numbers than the CPU's), and no GPU is visible here",
                        "rebuild it where a GPU is visible, or use the adapter directory with that base")
    if saved.get("method") == "qlora":
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[saved.get("compute_dtype") or "fp32"]
        model = build_quantised(cfg, device, dtype)
        return dequantised(model, build_model(cfg, meta=True))
    if device.type == "cpu":
        return build_model(cfg)
    model = build_model(cfg, meta=True)  # as Strategy.materialise_on_device draws it on a GPU
    model.to_empty(device=device)
    model.tie_weights()
    torch.manual_seed(cfg.seed)
    init_weights(model)
    return model.to("cpu")


# ---- export -------------------------------------------------------------------------------------------------------


def save_adapter(model: nn.Module, state: dict[str, torch.Tensor], out: Path, cfg: RunConfig, saved: dict[str, Any]) -> None:
    """peft's adapter directory (adapter_config.json, adapter_model.safetensors) from ``state`` (the model's state dict,
    or its adapter part), plus BASE_FILE: what rebuilds the base the adapter was trained on (``saved``: ``layout``'s
    record)."""
    adapter = {k: v.contiguous() for k, v in state.items() if ".lora_" in k}
    # save_embedding_layers: only adapters train (peft would otherwise look the base model up on the hub to decide)
    model.save_pretrained(out, state_dict=adapter, save_embedding_layers=False)
    base = {**saved, "tokenizer": cfg.tokenizer, "trust_remote_code": cfg.trust_remote_code}
    (out / BASE_FILE).write_text(json.dumps(base, indent=1))


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def base_record(adapter_dir: Path) -> dict[str, Any]:
    """An exported adapter's BASE_FILE; for an adapter written by another tool, its base as peft recorded it."""
    info_file = adapter_dir / BASE_FILE
    if info_file.is_file():
        info = json.loads(info_file.read_text())
    else:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        info = {"model": cfg.get("base_model_name_or_path"), "seed": 42, "method": "lora"}
    if not info.get("model"):
        raise UserError(f"the adapter in {str(adapter_dir)!r} does not say which base model it adapts",
                        "set base_model_name_or_path in its adapter_config.json")
    return info


def base_config(adapter_dir: Path, device: str = "cpu") -> RunConfig:
    """The RunConfig that rebuilds an exported adapter's base model (a preset from the run's seed)."""
    info = base_record(adapter_dir)
    return RunConfig(model=info["model"], seed=42 if info.get("seed") is None else int(info["seed"]), tokenizer=info.get("tokenizer"),
                     trust_remote_code=bool(info.get("trust_remote_code", False)), seq_len=1, device=device)


def load_adapted(adapter_dir: Path, device: str = "cpu") -> nn.Module:
    """The base model rebuilt by shardlab (``rebuild_base``: a preset from its seed, a GGUF, a directory, a hub id) with
    the adapter loaded by peft's ``PeftModel.from_pretrained``, in fp32 on ``device``."""
    base = rebuild_base(base_config(adapter_dir, device), base_record(adapter_dir))
    return _peft().PeftModel.from_pretrained(base, str(adapter_dir)).to(device)


__all__ = ["ADAPTER", "BASE_FILE", "check", "lora_config", "is_adapted", "apply", "adapter_parameters", "initialise",
           "base_only", "base_name", "targets", "summary", "describe", "layout", "quantised_layers", "four_bit_linear",
           "quantise", "build_quantised", "dequantised", "rebuild_base", "save_adapter", "is_adapter_dir", "base_record",
           "base_config", "load_adapted"]
