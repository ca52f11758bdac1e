"""A GGUF model dequantised by transformers, made an ordinary model again.

The tensors transformers loads from a GGUF file are plain ``dtype`` once dequantised, but newer transformers (5.24)
keep the GGUF quantizer on the model (``hf_quantizer``, and ``config.quantization_config``), and ``save_pretrained``
then refuses it ("quantized with gguf and is not serializable"): shardlab keeps the dequantised weights as a
save_pretrained directory (gguf_files.gguf_weights_cached) and exports runs the same way. Dropping both makes it the
normal model it is. Without the patch transformers' own refusal stands.
"""

from __future__ import annotations

from typing import Any

from . import applied, enabled


def drop_quantizer(model: Any) -> None:
    """Forget the GGUF quantizer of a dequantised ``model`` (in place), where transformers kept one."""
    kept = getattr(model, "hf_quantizer", None) is not None or hasattr(model.config, "quantization_config")
    if not kept or not enabled("gguf_quantizer"):
        return
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    applied("gguf_quantizer")
