"""What DeepSpeed's own config models accept: the names one ZeRO setting goes by, and a check of a whole JSON.

DeepSpeed validates its JSON with pydantic models (runtime/config.py, runtime/zero/config.py, compile/config.py, ...)
only inside `deepspeed.initialize`, on every rank, after the spawn: one refused key is a traceback per rank. The same
models, asked here in the launching process, give every refused key at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

from ..errors import UserError

# Lazy imports below: deepspeed (seconds to import) loads only when a user's JSON is merged or checked.

# The batch triple the check fills in: DeepSpeed derives the global batch from these for whatever world size it sees
# (1 in the launching process), and shardlab checks the triple itself (deepspeed_json.merge_user_config).
_CHECK_BATCH = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


@functools.lru_cache(maxsize=1)
def zero_setting_names() -> dict[str, frozenset[str]]:
    """Every name of a `zero_optimization` key -> all the names of its setting: the field name, its alias
    (`max_live_parameters` / `stage3_max_live_parameters`) and the deprecated names DeepSpeed still reads into it
    (`stage3_gather_fp16_weights_on_model_save`, `cpu_offload`). DeepSpeed refuses two names of one setting together."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    groups: dict[str, set[str]] = {}
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        groups.setdefault(name, {name}).update({field.alias} if field.alias else set())
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        new = extra.get("new_param")
        if extra.get("deprecated") and new in groups and extra.get("set_new_param", True):
            groups[new].add(name)
            groups[name] = groups[new]
    return {n: frozenset(group) for group in groups.values() for n in group}


def same_setting(a: str, b: str) -> bool:
    """Whether two `zero_optimization` keys name one DeepSpeed setting."""
    return a == b or b in zero_setting_names().get(a, ())


@contextlib.contextmanager
def _deepspeed_quiet():
    """DeepSpeed logs its config (and each deprecated name) at INFO/WARNING on stdout while it parses."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _problems(config: dict[str, Any], section: str | None) -> list[str]:
    """What DeepSpeed's DeepSpeedConfig says against `config`, one entry per refused key ("zero_optimization.x: why")."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    try:
        with _deepspeed_quiet():
            DeepSpeedConfig(config)
    except ValidationError as err:
        out = []
        for e in err.errors():
            loc = [str(p) for p in e["loc"]]
            if section and loc[:1] != [section]:  # the monitor model nests its sections under their own names
                loc = [section, *loc]
            why = "not a key DeepSpeed knows" if e["type"] == "extra_forbidden" else e["msg"][0].lower() + e["msg"][1:]
            got = f" = {e['input']!r}" if e["type"] != "extra_forbidden" and not isinstance(e.get("input"), dict) else ""
            out.append(f"{'.'.join(loc) or section}{got}: {why}")
        return out
    except Exception as err:  # noqa: BLE001 - DeepSpeed asserts and raises plain errors for the rest
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [f"{section}: {message}" if section else message]
    return []


def check_with_deepspeed(ds: dict[str, Any], name: str) -> None:
    """Refuse, in one line naming every refused key, a DeepSpeed JSON that DeepSpeed's own config models would refuse
    in each rank. Each section is asked alone, so that one bad section does not hide the next; the whole JSON then
    once, for what sections say about each other (bf16 and fp16 both on)."""
    import deepspeed

    rest = {k: v for k, v in ds.items() if k not in _BATCH_KEYS}
    problems = [p for key, value in rest.items() for p in _problems({**_CHECK_BATCH, key: value}, key)]
    if not problems:
        problems = _problems({**_CHECK_BATCH, **rest}, None)
    if problems:
        raise UserError(f"DeepSpeed {deepspeed.__version__} refuses {len(problems)} setting(s) of {name}: {'; '.join(problems)}",
                        "remove or correct them in the JSON (\"auto\" lets shardlab fill a value from the run)")
