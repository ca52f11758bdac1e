"""A user's own DeepSpeed JSON (--deepspeed-config): read it, take what it decides for the run, merge it over
shardlab's generated JSON.

Peers' templates (accelerate's, Axolotl's, transformers' tests', DeepSpeed-Chat's) run unchanged: HF-style "auto"
values are filled from the run; the strategy, precision and batch sizes a JSON sets are taken where the run left them
open; where DeepSpeed reads one setting under several names (an alias, a deprecated name), the user's name wins; and
the `compile` section of DeepSpeed <= 0.15, which DeepSpeed 0.19 refuses, becomes --compile. What DeepSpeed would still
refuse is reported before any worker starts (deepspeed_schema.check_with_deepspeed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import UserError
from ..runtime.resolved import resolve_precision
from .deepspeed_schema import same_setting
from ..specs.registry import spec

# Lazy import below: hjson only for a user JSON, inside read_user_json's error handling.

# What `total_num_steps: "auto"` shows before the run knows its length (dry run, pre-spawn check).
TOTAL_STEPS_LATER = "<the run's optimizer steps>"

# The run's batch triple and the JSON keys that set it.
BATCH_KEYS = (("micro_batch", "train_micro_batch_size_per_gpu"), ("grad_accum", "gradient_accumulation_steps"),
              ("global_batch", "train_batch_size"))
# DeepSpeed <= 0.15's `compile` section (runtime/compiler.py CompileConfig: disable, backend, kwargs): torch.compile
# of the engine's module. DeepSpeed 0.19's section configures DeepCompile instead and refuses these keys.
LEGACY_COMPILE_KEYS = ("disable", "backend", "kwargs")


def _auto_values(base: dict[str, Any], cfg: RunConfig, total_steps: int | None = None) -> dict[str, Any]:
    """What HF-style "auto" means, taken from the run config (not from the generated optimizer
    section, which is absent when shardlab passes torch's AdamW)."""
    zero = base["zero_optimization"]
    return {
        "train_micro_batch_size_per_gpu": base["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": base["gradient_accumulation_steps"],
        "train_batch_size": base["train_batch_size"],
        "gradient_clipping": base["gradient_clipping"],
        "lr": cfg.lr,
        "betas": [cfg.adam_beta1, cfg.adam_beta2],
        "eps": cfg.adam_eps,
        "weight_decay": cfg.weight_decay,
        # DeepSpeed's WarmupLR refuses 0 (and warms up over max(2, n) steps, the first at warmup_min_lr): no warm-up is 1
        "warmup_num_steps": max(1, cfg.warmup_steps),
        "warmup_max_lr": cfg.lr,
        "warmup_min_lr": cfg.lr * cfg.min_lr_ratio,  # where shardlab's own schedule ends, as WarmupDecayLR's does
        "total_num_steps": total_steps if total_steps is not None else TOTAL_STEPS_LATER,
        "reduce_bucket_size": zero["reduce_bucket_size"],
        "stage3_prefetch_bucket_size": zero.get("stage3_prefetch_bucket_size"),
        "stage3_param_persistence_threshold": zero.get("stage3_param_persistence_threshold"),
        "stage3_gather_16bit_weights_on_model_save": False,  # export gathers the weights itself (full_state_dict)
    }


def _fill_auto(node: Any, values: dict[str, Any], key: str | None = None) -> Any:
    if isinstance(node, dict):
        return {k: _fill_auto(v, values, k) for k, v in node.items()}
    if node == "auto":
        if key == "enabled":
            return None  # resolved by the precision merge below
        if key not in values or values[key] is None:
            raise UserError(f"DeepSpeed config value {key!r} is 'auto' but shardlab cannot fill it", f"give {key!r} a number")
        return values[key]
    return node


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out

def _runs_on(precision: str, device_type: str) -> bool:
    try:
        resolve_precision(precision, device_type)
    except UserError:
        return False
    return True




def read_user_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"DeepSpeed config {path!r} not found", "check the path given to --deepspeed-config")
    try:
        import hjson  # DeepSpeed accepts hjson (comments, trailing commas); so do we

        user = json.loads(json.dumps(hjson.loads(p.read_text())))
    except Exception:
        raise UserError(f"DeepSpeed config {path!r} is not valid JSON", "fix its syntax") from None
    if not isinstance(user, dict):
        raise UserError(f"DeepSpeed config {path!r} is not a JSON object", "write a {...} DeepSpeed config")
    if "bfloat16" in user and "bf16" not in user:  # DeepSpeed's older name (DeepSpeed-Chat writes it), read the same
        user["bf16"] = user.pop("bfloat16")
    return user


def _offload_devices(zero: dict[str, Any]) -> tuple[str | None, str | None]:
    """Where a JSON's zero_optimization puts the optimizer states and the parameters (None: on the accelerator),
    also in DeepSpeed's deprecated spelling (`cpu_offload`, `cpu_offload_param`)."""
    def device(key: str, deprecated: str) -> str | None:
        found = (zero.get(key) or {}).get("device") if isinstance(zero.get(key), dict) else None
        found = found or ("cpu" if zero.get(deprecated) is True else None)
        return None if found in (None, "none") else found

    return device("offload_optimizer", "cpu_offload"), device("offload_param", "cpu_offload_param")


def json_strategy(user: dict[str, Any]) -> tuple[str | None, str]:
    """The shardlab strategy a DeepSpeed JSON's zero_optimization describes (None: it sets no stage), and why."""
    zero = user.get("zero_optimization") or {}
    stage = zero.get("stage")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        return None, "no zero_optimization.stage"
    devices = set(_offload_devices(zero)) - {None}
    where = f"zero_optimization.stage {stage}" + (f", offload to {' and '.join(sorted(devices))}" if devices else "")
    if "nvme" in devices:
        return ("infinity" if stage == 3 else None), where
    if "cpu" in devices:
        return (f"zero{stage}_offload" if stage else None), where
    return f"zero{stage}", where


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def adopt_user_json(cfg: RunConfig, device_type: str) -> tuple[RunConfig, list[str]]:
    """A user's DeepSpeed JSON decides what the run left open: the strategy from its zero_optimization (a given
    --strategy must match it), the precision from its bf16/fp16 section where this device can run it, the batch sizes
    when no --micro-batch/--grad-accum/--global-batch was given, --compile from an old `compile` section.
    Returns the config to run and the lines to log."""
    if not cfg.deepspeed_config:
        return cfg, []

    user = read_user_json(cfg.deepspeed_config)
    notes: list[str] = []
    name = Path(cfg.deepspeed_config).name
    strategy, where = json_strategy(user)
    if strategy is None and where != "no zero_optimization.stage":
        raise UserError(f"DeepSpeed config {name} has {where}, which no shardlab strategy runs",
                        "offload needs stage 1-3 (cpu) or 3 (nvme, strategy infinity)")
    if strategy is not None and strategy != cfg.strategy:
        if "strategy" in cfg.model_fields_set:
            raise UserError(f"DeepSpeed config {name} has {where}, which is strategy {strategy}, but --strategy is {cfg.strategy}",
                            f"pass --strategy {strategy}, or drop --strategy and shardlab takes it from the JSON")
        cfg = cfg.model_copy(update={"strategy": strategy})
        notes.append(f"strategy {strategy}, from {name} ({where})")
    if strategy is not None:
        notes += _offload_added(user, strategy, name)
    if cfg.precision == "auto":
        enabled = [sec for sec in ("bf16", "fp16") if (user.get(sec) or {}).get("enabled") is True]
        if enabled and _runs_on(enabled[0], device_type):
            cfg = cfg.model_copy(update={"precision": enabled[0]})
            notes.append(f"precision {enabled[0]}, from {name}")
        elif enabled:
            chosen = resolve_precision("auto", device_type).name
            notes.append(f"{name} enables {enabled[0]}, which {device_type.upper()} training does not support: precision {chosen}, "
                         f"its {enabled[0]} section is turned off")
    taken = {field: user[key] for field, key in BATCH_KEYS if _positive_int(user.get(key))}
    if taken and all(getattr(cfg, field) is None for field, _ in BATCH_KEYS):
        cfg = cfg.model_copy(update=taken)
        notes.append(f"batch sizes from {name} ({', '.join(f'{key} {user[key]}' for field, key in BATCH_KEYS if field in taken)}): "
                     "no --micro-batch, --grad-accum or --global-batch given")
    cfg, compile_note = _adopt_legacy_compile(cfg, user, name)
    notes += compile_note
    scheduler = (user.get("scheduler") or {}).get("params") or {}
    if scheduler.get("warmup_num_steps") == "auto" and cfg.warmup_steps == 0:
        notes.append(f"{name}'s scheduler warmup_num_steps 'auto' with no warm-up: 1 (DeepSpeed's WarmupLR refuses 0; "
                     "its first step runs at warmup_min_lr)")
    return cfg, notes


def _offload_added(user: dict[str, Any], strategy: str, name: str) -> list[str]:
    """What the strategy offloads that the JSON does not (Axolotl's zero3_bf16_cpuoffload_params.json offloads the
    parameters only; zero3_offload also moves the optimizer states and their step to the CPU): said, not silent."""
    optimizer, params = _offload_devices(user.get("zero_optimization") or {})
    s = spec(strategy)
    added = [f"{key} {{device: {mine}}}" for key, mine, theirs in (("offload_optimizer", s.offload_optimizer, optimizer),
                                                                  ("offload_param", s.offload_params, params)) if mine and not theirs]
    if not added:
        return []
    alone = "the parameters" if added[0].startswith("offload_optimizer") else "the optimizer states"
    return [f"{name} offloads {alone} only; strategy {strategy} adds {' and '.join(added)} "
            f"(no shardlab strategy offloads {alone} alone)"]


def _adopt_legacy_compile(cfg: RunConfig, user: dict[str, Any], name: str) -> tuple[RunConfig, list[str]]:
    """An old DeepSpeed `compile` section ({"disable": false, "backend": "inductor"}: Axolotl's *_torch_compile.json)
    asked DeepSpeed to torch.compile its engine, which is what --compile does with a DeepSpeed strategy."""
    section = user.get("compile") if isinstance(user.get("compile"), dict) else {}
    legacy = {k: v for k, v in section.items() if k in LEGACY_COMPILE_KEYS}
    if not legacy:
        return cfg, []
    if legacy.get("backend", "inductor") != "inductor":
        raise UserError(f"DeepSpeed config {name} sets compile.backend {legacy['backend']!r}; shardlab compiles DeepSpeed's engine with inductor",
                        "remove compile.backend from the JSON (or set it to \"inductor\")")
    if legacy.get("kwargs"):
        raise UserError(f"DeepSpeed config {name} sets compile.kwargs {legacy['kwargs']!r}, which shardlab does not pass on",
                        "remove compile.kwargs from the JSON; --set compile_mode=... sets torch.compile's mode")
    wanted = not legacy.get("disable", False)
    how = f"{name}'s compile section ({', '.join(f'{k}: {json.dumps(v)}' for k, v in legacy.items())}, DeepSpeed <= 0.15's form, which DeepSpeed 0.19 refuses)"
    if "compile" in cfg.model_fields_set and cfg.compile != wanted:
        return cfg, [f"{how} is not passed on; --{'' if cfg.compile else 'no-'}compile given"]
    if wanted and not cfg.compile:
        return cfg.model_copy(update={"compile": True}), [f"--compile, from {how}: torch.compile of DeepSpeed's engine; the section is not passed on"]
    return cfg, [f"{how} is not passed on"]


def explain_batch_error(cfg: RunConfig, err: UserError) -> UserError:
    """A batch-triple error (RunConfig.resolve_batch) of sizes taken from the user's JSON (adopt_user_json), told as
    the JSON's: the user gave no batch flag, so "give only two of --micro-batch, ..." would point at nothing."""
    if not cfg.deepspeed_config:
        return err
    user = read_user_json(cfg.deepspeed_config)
    from_json = [f"{key} {user[key]}" for field, key in BATCH_KEYS if getattr(cfg, field) is not None and getattr(cfg, field) == user.get(key)]
    if not from_json:
        return err
    return UserError(f"{Path(cfg.deepspeed_config).name} sets {', '.join(from_json)}, which this run cannot use: {err.message}",
                     'set them to "auto" in the JSON (shardlab then derives them), or pass --micro-batch/--grad-accum/--global-batch')


def _merge_zero(base: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """shardlab's zero_optimization without the keys that name the same setting as one of the user's under another
    name (`stage3_max_live_parameters` beside Axolotl's `max_live_parameters`, `stage3_gather_16bit_weights_on_model_save`
    beside transformers' deprecated `stage3_gather_fp16_weights_on_model_save`): DeepSpeed refuses both together."""
    return {k: v for k, v in base.items() if not any(u != k and same_setting(k, u) for u in user)}


def merge_user_config(base: dict[str, Any], path: str, precision: str, cfg: RunConfig, total_steps: int | None = None,
                      device_type: str | None = None) -> dict[str, Any]:
    """Overlay a user's DeepSpeed JSON on the generated one; the batch triple must agree with the run."""
    user = _fill_auto(read_user_json(path), _auto_values(base, cfg, total_steps))
    stage = user.get("zero_optimization", {}).get("stage")
    if stage is not None and stage != base["zero_optimization"]["stage"]:
        raise UserError(
            f"DeepSpeed config sets zero_optimization.stage={stage} but strategy {cfg.strategy!r} is ZeRO-{base['zero_optimization']['stage']}",
            f"pass --strategy zero{stage} (or its _offload variant), or remove the stage from the JSON",
        )
    for section, wanted in (("bf16", precision == "bf16"), ("fp16", precision == "fp16")):
        if section in user and (user[section].get("enabled") is None or (
                cfg.precision == "auto" and device_type is not None and not _runs_on(section, device_type))):
            user[section]["enabled"] = wanted  # "auto", or a precision this device cannot run (adopt_user_json said so)
        elif section in user and bool(user[section].get("enabled")) != wanted:
            raise UserError(
                f"DeepSpeed config enables {section} = {user[section].get('enabled')} but the run's precision is {precision}",
                f"set {section}.enabled to \"auto\" or pass --precision to match",
            )
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if key in user and user[key] != base[key]:
            raise UserError(
                f"DeepSpeed config sets {key}={user[key]} but the run resolves it to {base[key]}",
                f"set {key} to \"auto\" in the JSON, or pass the matching --micro-batch/--grad-accum/--global-batch",
            )
    if isinstance(user.get("compile"), dict):  # the old section became --compile (adopt_user_json); DeepSpeed 0.19 refuses it
        user["compile"] = {k: v for k, v in user["compile"].items() if k not in LEGACY_COMPILE_KEYS}
        if not user["compile"]:
            del user["compile"]
    if isinstance(user.get("zero_optimization"), dict):
        base = {**base, "zero_optimization": _merge_zero(base["zero_optimization"], user["zero_optimization"])}
    return _deep_merge(base, user)
