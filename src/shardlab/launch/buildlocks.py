"""Stale JIT-build locks: a DeepSpeed op build that was killed leaves a lock that hangs every later run.

DeepSpeed builds its CPU ops (cpu_adam, shm_comm, ...) with torch's JIT extension loader the first time a
run needs them. torch guards the build directory with a FileBaton: the builder creates ``<op>/lock`` and
removes it when done; everybody else polls until the file is gone, with no timeout. A build killed half
way (kill -9, a test or bench timeout, a node lost) never removes it, and from then on every run that
loads that op waits forever without a word, even when the op is already built.

The builder holds the lock file open for the whole build, so a lock that no process on this node has open
and that is older than any build is stale. The age bound keeps a build running on *another* node (a home
directory shared over NFS) safe from us.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Lazy import below: torch.utils.cpp_extension only when a build root is looked for; this module itself is torch-free.

# cpu_adam builds in ~60-90 s on 2 cores; a lock this old that nobody here holds is left over.
STALE_AFTER_S = 300.0


def extension_roots() -> list[Path]:
    """Where torch's JIT loader keeps extension builds (TORCH_EXTENSIONS_DIR, else its default root)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return [Path(env)]
    from torch.utils.cpp_extension import get_default_build_root

    return [Path(get_default_build_root())]


def build_locks(roots: list[Path] | None = None) -> list[Path]:
    """Every ``lock`` file under the roots: <root>/<op>/lock and <root>/py311_cpu/<op>/lock (torch's default)."""
    found: list[Path] = []
    for root in roots if roots is not None else extension_roots():
        if root.is_dir():
            found += list(root.glob("*/lock")) + list(root.glob("*/*/lock"))
    return sorted(found)


def open_by_a_process(path: Path) -> bool:
    """Whether any process we can inspect on this node has ``path`` open (Linux /proc; False elsewhere)."""
    target = os.path.realpath(path)
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            fds = list(os.scandir(fd_dir))
        except OSError:  # another user's process, or it just ended
            continue
        for fd in fds:
            try:
                if os.readlink(fd.path) == target:
                    return True
            except OSError:
                continue
    return False


def clear_stale_build_locks(say, roots: list[Path] | None = None, stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the build locks nobody holds and that are older than a build; name the younger ones. Returns the removed."""
    removed = []
    for lock in build_locks(roots):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        if open_by_a_process(lock):
            continue  # a build in progress on this node: the run waits for it, as it should
        if age >= stale_after_s:
            try:
                lock.unlink()
            except FileNotFoundError:
                continue
            removed.append(lock)
            say(f"removed a stale build lock left by a killed DeepSpeed/torch op build ({age / 60:.0f} min old, held by no process): {lock}")
        else:
            say(f"note: {lock} is held by no process on this node; if no other node is building that op, "
                f"delete it (a killed build leaves it, and the run waits on it)")
    return removed
