"""Strategies: the short names users type -> their spec (shardlab/specs/) and the class that implements them.

One file per engine (ddp.py, deepspeed_zero.py, fsdp.py, ...), as Lightning Fabric does; each name's
facts are declared once in shardlab/specs/, below config and the training pieces, which read them.
This package imports no torch until a class is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..specs import registry  # the module, as `strategies.registry`
from ..specs.registry import names

if TYPE_CHECKING:
    from .base import Strategy


def strategy_class(name: str) -> type[Strategy]:
    return registry.spec(name).load()


def __getattr__(attr: str):
    # `from shardlab.strategies import Strategy` keeps working without importing torch for everyone else.
    if attr == "Strategy":
        from .base import Strategy

        return Strategy
    raise AttributeError(attr)


__all__ = ["Strategy", "strategy_class", "names", "registry"]
