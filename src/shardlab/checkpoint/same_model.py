"""A checkpoint resumes only into the model it was written from: compared before any worker starts.

Resuming a tiny-llama run with `--model tiny-gpt2` failed in every rank's checkpoint load ("Missing key in checkpoint
state_dict: model.transformer.wte.weight"), after the run directory had been written. The checkpoint keeps the run's
config (store.CONFIG_FILE); its model's architecture is built from it without weights and compared with this run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..config import RunConfig
from ..errors import UserError
from ..training.models import build_hf_config
from .store import CONFIG_FILE, find_resume_dir

# What must agree for a checkpoint's tensors to load into the model: every name and shape follows from these.
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size")


def architecture(hf_config: Any) -> dict[str, Any]:
    return {key: getattr(hf_config, key, None) for key in ARCHITECTURE_KEYS}


def _describe(model: str, arch: dict[str, Any]) -> str:
    return (f"{model}: {arch['model_type']}, {arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, "
            f"vocabulary {arch['vocab_size']}")


def check_same_model(cfg: RunConfig, hf_config: Any) -> None:
    """Refuse `--resume` from a checkpoint of another model (architecture or vocabulary) in one line. A checkpoint
    whose model cannot be read here (no config saved, a directory since removed) is left to the load to judge."""
    if not cfg.resume:
        return
    found = find_resume_dir(cfg.resume, Path(cfg.output_dir))
    if found is None or not (found / CONFIG_FILE).is_file():
        return
    try:
        saved = yaml.safe_load((found / CONFIG_FILE).read_text())
        # remote code only where this run allows it: a checkpoint's config.yaml is not the user's consent
        saved_cfg = RunConfig(model=saved["model"], tokenizer=saved.get("tokenizer"), seq_len=int(saved.get("seq_len", 128)),
                              trust_remote_code=bool(saved.get("trust_remote_code", False)) and cfg.trust_remote_code)
        theirs = architecture(build_hf_config(saved_cfg))
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError, UserError):
        return
    mine = architecture(hf_config)
    if mine != theirs:
        raise UserError(f"--resume {cfg.resume}: checkpoint {str(found)!r} holds another model ({_describe(saved_cfg.model, theirs)}) "
                        f"than this run builds ({_describe(cfg.model, mine)}); its weights cannot load into it",
                        f"resume with --model {saved_cfg.model}, or drop --resume to train {cfg.model} from its own weights")
