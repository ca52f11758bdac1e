"""transformers' per-module weight initialisation, intercepted (training/init_by_module.py: why).

``PreTrainedModel.init_weights`` walks the model with ``smart_apply``, which calls each (sub-)model's
``_initialize_weights(module, is_custom_code)`` children first, reading it from the model instance. Setting that
attribute on each ``PreTrainedModel`` instance of the model, for the duration of one ``init_weights`` call, lets
shardlab see every module's initialisation (and give its tensors storage just in time) while transformers draws
exactly what it would. Nothing outlives the call. Outside the transformers versions this was tested on, FSDP on
several ranks initialises each shard in place (strategies/fsdp.random_init_by_module asks ``enabled`` first).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from . import applied


@contextlib.contextmanager
def each_module_init(owners: list, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """While inside, each of ``owners`` (the PreTrainedModel instances of one model) initialises a module through
    ``wrap(its own _initialize_weights)``."""
    for owner in owners:
        owner._initialize_weights = wrap(owner._initialize_weights)
    applied("init_by_module")
    try:
        yield
    finally:
        for owner in owners:
            del owner._initialize_weights
