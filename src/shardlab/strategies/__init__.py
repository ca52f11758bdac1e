"""Registry of strategies: the short names users type -> the class that implements them.

One file per engine (ddp.py, deepspeed_zero.py, fsdp.py), as Lightning Fabric does.
"""

from __future__ import annotations

from ..config import STRATEGIES
from ..errors import UserError
from .base import Strategy


def strategy_class(name: str) -> type[Strategy]:
    if name == "dp":
        from .ddp import DDPStrategy

        return DDPStrategy
    if name.startswith("zero") or name == "infinity":
        from .deepspeed_zero import DeepSpeedStrategy

        return DeepSpeedStrategy
    if name == "ao_offload":
        from .ao_offload import AOOffloadStrategy

        return AOOffloadStrategy
    if name == "pipeline":
        from .pipeline import PipelineStrategy

        return PipelineStrategy
    if name.startswith("fsdp"):
        from .fsdp import FSDPStrategy

        return FSDPStrategy
    raise UserError(f"unknown strategy {name!r}", f"choose one of {', '.join(STRATEGIES)}")


def uses_deepspeed(name: str) -> bool:
    return name.startswith("zero") or name == "infinity"


__all__ = ["Strategy", "strategy_class", "uses_deepspeed", "STRATEGIES"]
