"""Dotted config keys (``dataset.source``) in nested dicts: the one getter and the one setter.

Used by config.load_config (flags and ``--set``), bench.matrix (suite overrides) and report.load
(a run's saved config). Torch-free and pydantic-free, so that the report side stays light.
"""

from __future__ import annotations

from typing import Any

from .errors import UserError


def get_dotted(data: Any, dotted: str, default: Any = None) -> Any:
    """``data["a"]["b"]["c"]`` for ``"a.b.c"``; `default` where any step is missing or not a mapping."""
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def set_dotted(data: dict[str, Any], dotted: str, value: Any, hint: str = "check the key path") -> None:
    """Set ``data["a"]["b"]["c"] = value`` for ``"a.b.c"``, creating the mappings on the way.

    A parent that is None (a YAML key written with no value, ``strategy_options:``) becomes a fresh
    mapping, as config.load_config always did; bench.matrix's former copy used ``setdefault`` and so
    refused such a parent as "not a mapping", though the same YAML given to `shardlab train` works.
    Anything else that is not a mapping is a UserError naming the key; `hint` says where to look.
    """
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise UserError(f"cannot set {dotted!r}: {key!r} is not a mapping", hint)
        node = child
    node[keys[-1]] = value
