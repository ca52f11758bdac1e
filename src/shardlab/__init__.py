"""shardlab: fine-tune Hugging Face causal LMs under every memory/parallelism strategy, measured honestly.

Library use mirrors the CLI:

    from shardlab import load_config, train
    result = train(load_config("examples/quick-test.yaml", {"max_steps": 5}))

Layout: packages by concern (cli, launch, loop, training, runtime, data, strategies, specs, checkpoint, measure,
planning, pipesim, bench, report; docs/about.md "Code layout"; pyproject.toml holds their layers). errors.py and
config.py stay at the top as the base layer every package imports; config is one module, so a config/ package would only add a level. The packages are `training/`
and `planning/`, not `train/` and `plan/`, because `shardlab.train` and `shardlab.plan` are the functions below.
"""

__version__ = "0.1.0"

import logging as _logging

# transformers imports torchao whenever it is installed (the `offload` extra). torchao then logs a warning for
# each optional C++ kernel built for another torch version, and torch's pytree logs a deprecation per torchao
# enum: several lines on every command, which would bury shardlab's one-line errors. shardlab uses only
# torchao's pure-Python optimizers, which those kernels do not affect, so both loggers are kept to errors.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

from .config import RunConfig, load_config  # noqa: E402,F401
from .errors import UserError  # noqa: E402,F401


def train(cfg: RunConfig):
    """Train as `shardlab train` does: in this process (returns a RunResult) or across spawned workers."""
    import time

    started = time.time()  # the run's clock starts at this call, its imports included, not at the interpreter's start
    from .launch.launcher import train as _train  # torch and the engines load only when training

    return _train(cfg, started=started)


def plan(cfg: RunConfig, **kwargs):
    """Predict per-GPU/CPU/NVMe memory of every strategy for `cfg` (see shardlab.planning.planner.plan)."""
    from .planning.planner import plan as _plan  # torch loads only when planning

    return _plan(cfg, **kwargs)


__all__ = ["RunConfig", "UserError", "load_config", "plan", "train"]
