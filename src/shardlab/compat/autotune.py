"""Inductor's autotuner clones the arguments a kernel mutates on the GPU, not in pinned host memory.

When inductor benchmarks a new kernel's configurations, a kernel that mutates its arguments works on copies: clones on
the GPU where they fit under the peak so far, otherwise pinned host copies
(torch/_inductor/runtime/triton_heuristics.py, ``CachingAutotuner.copy_args_to_cpu_if_needed``). shardlab autotunes
torchao's 8-bit step before training (loop/warm_8bit.py: why), when the GPU holds only the weights: there the
clones fit, and answering "nothing to copy" for that moment keeps the host out of it. Outside the torch versions this
was tested on, inductor decides as it would anyway.
"""

from __future__ import annotations

import contextlib

from . import applied, enabled


@contextlib.contextmanager
def clones_on_device():
    """Inductor's autotuner clones mutated arguments on the device instead of copying them to pinned host memory.
    Yields whether it could (torch's private API moved, or the patch is off: then inductor decides as it would
    anyway)."""
    if not enabled("autotune_clones"):
        yield False
        return
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        yield False
        return
    original = CachingAutotuner.__dict__.get("copy_args_to_cpu_if_needed")
    if original is None:
        yield False
        return
    # An empty dict is inductor's own answer for kernels that need no copies: every mutated argument is cloned instead.
    CachingAutotuner.copy_args_to_cpu_if_needed = lambda self, *args, **kwargs: {}
    applied("autotune_clones")
    try:
        yield True
    finally:
        CachingAutotuner.copy_args_to_cpu_if_needed = original
