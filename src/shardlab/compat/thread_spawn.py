"""Every creator of a thread or process runs with the pinned thread's full CPU set (runtime/pin.py: why).

Linux gives a new thread or process its creator's affinity mask. While a rank's training thread is pinned to one CPU,
whatever it creates would be pinned there too, so each creator is wrapped to widen the mask for the moment of
creation: ``threading.Thread.start``; CPython's ``subprocess.Popen._execute_child`` and
``multiprocessing.util.spawnv_passfds`` (they exec without running at-fork hooks); ``os.posix_spawn`` and
``os.posix_spawnp``; and ``os.fork`` through at-fork hooks (multiprocessing's fork start method, DataLoader
workers). The wrappers are undone when the pin is released (``uninstall``); at-fork hooks cannot be unregistered, so
they stay, inert while nothing is pinned. Outside the CPython versions this was tested on, the pin is not made (pin.py
asks ``enabled`` first): a creator missed by the wrappers would leave new threads on one CPU.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable

from . import applied

_MARK = "_shardlab_widened"


class _Hooks:
    widen: Callable[[], bool] | None = None  # widens the calling thread's mask if it is the pinned one; whether it did
    narrow: Callable[[], None] | None = None
    forget_in_child: Callable[[], None] | None = None  # a forked child's thread is not the pinned one
    originals: list[tuple[Any, str, Callable]] = []
    fork_hooks = False


def _creators() -> list[tuple[Any, str]]:
    import multiprocessing.util
    import subprocess

    return [(threading.Thread, "start"), (subprocess.Popen, "_execute_child"), (multiprocessing.util, "spawnv_passfds"),
            (os, "posix_spawn"), (os, "posix_spawnp")]


def _widened(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        widened = _Hooks.widen is not None and _Hooks.widen()
        try:
            return fn(*args, **kwargs)
        finally:
            if widened:
                _Hooks.narrow()

    setattr(wrapper, _MARK, True)
    return wrapper


def _register_fork_hooks() -> None:
    """os.fork: the child is a copy of the forking thread, mask included. Widen before, narrow again in the parent;
    the child keeps the full set. Once per process (they cannot be removed), through _Hooks."""
    if _Hooks.fork_hooks:
        return
    state = {"widened": False}

    def before():
        state["widened"] = _Hooks.widen is not None and _Hooks.widen()

    def after_in_parent():
        if state["widened"]:
            state["widened"] = False
            _Hooks.narrow()

    def after_in_child():
        if state["widened"]:
            state["widened"] = False
            _Hooks.forget_in_child()

    os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=after_in_child)
    _Hooks.fork_hooks = True


def install(widen: Callable[[], bool], narrow: Callable[[], None], forget_in_child: Callable[[], None]) -> None:
    """Wrap every creator (once; the caller asked ``compat.enabled("thread_spawn")``)."""
    _Hooks.widen, _Hooks.narrow, _Hooks.forget_in_child = widen, narrow, forget_in_child
    if not _Hooks.originals:
        for owner, name in _creators():
            fn = getattr(owner, name, None)
            if fn is not None and not getattr(fn, _MARK, False):
                setattr(owner, name, _widened(fn))
                _Hooks.originals.append((owner, name, fn))
    _register_fork_hooks()
    applied("thread_spawn", uninstall)


def uninstall() -> None:
    """Put CPython's creators back; the at-fork hooks stay, doing nothing."""
    for owner, name, fn in reversed(_Hooks.originals):
        setattr(owner, name, fn)
    _Hooks.originals = []
    _Hooks.widen = _Hooks.narrow = _Hooks.forget_in_child = None
