"""One live run per output directory: an flock on OUTPUT_DIR/.shardlab.lock, held while the run's launcher lives.

Two runs writing one directory mix their files, and a second run's --overwrite would delete the live one's. The
refusal cannot rest on which files exist (a run writes config.yaml only once its data is staged), so the run holds
a lock from before it deletes or writes anything until it ends. The kernel drops an flock when its holder dies (kill
-9, the OOM killer), so a crashed run never leaves a stale lock behind: the next run takes it over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from ..errors import UserError

LOCK_NAME = ".shardlab.lock"


def _holder(fd: int) -> dict:
    """What the live run wrote into its lock file: {"pid": N, "started": "..."} ({} if it has not written it yet)."""
    try:
        held = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) and "pid" in held else {}


def _refusal(out: Path, holder: dict) -> UserError:
    who = f"pid {holder['pid']}, started {holder.get('started', '?')}" if holder else "its pid not yet recorded"
    stop = f"`kill {holder['pid']}`" if holder else "stop it"
    return UserError(f"output dir {str(out)!r} is in use by a live shardlab run ({who}); a second run would mix its files "
                     "with the live one's, and --overwrite would delete them under it",
                     f"wait for that run to end or stop it ({stop}: it checkpoints and exits), or pass another --output-dir")


def live_run(output_dir: str | Path) -> dict | None:
    """The live run holding the directory's lock (_holder's record), or None when none does; creates nothing."""
    path = Path(output_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def check_no_live_run(output_dir: str | Path) -> None:
    """The refusal a run would meet now (a dry run says it without taking the lock)."""
    holder = live_run(output_dir)
    if holder is not None:
        raise _refusal(Path(output_dir), holder)


class OutputDirLock:
    """Held for the life of a run (a `with` block in the launching process). A second run is refused in one line
    naming the live run's pid, with or without --overwrite."""

    def __init__(self, output_dir: str | Path, user_pid: int | None = None, say=print):
        """``user_pid``: the pid to name in a refusal, that of the command the user started (default: this process)."""
        self.out = Path(output_dir)
        self.user_pid = user_pid or os.getpid()
        self.say = say
        self.fd: int | None = None
        self.created_dir = False

    def __enter__(self) -> "OutputDirLock":
        self.created_dir = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                self._drop_created_dir()
                raise _refusal(self.out, holder) from None
            except OSError as err:  # a filesystem without flock (some NFS mounts): run unguarded, and say so
                os.close(fd)
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self.say(f"[shardlab] {self.out} cannot be locked ({err.strerror}): nothing stops a second run from using it")
                return self
            try:  # the holder unlinks the file before it lets go: a lock on an unlinked file guards nothing, so retry
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        record = {"pid": self.user_pid, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "created_dir": self.created_dir}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        try:
            (self.out / LOCK_NAME).unlink(missing_ok=True)  # while still held: see the retry in __enter__
        finally:
            os.close(self.fd)
            self.fd = None
        self._drop_created_dir()

    def _drop_created_dir(self) -> None:
        """A run refused before it wrote anything leaves no directory it created behind."""
        if self.created_dir:
            try:
                self.out.rmdir()
            except OSError:  # not empty (the run wrote its files) or gone
                pass


def remove_left_by_killed_run(output_dir: str | Path) -> None:
    """What a launcher killed before its run wrote anything leaves (the supervisor ends a node that waits for the
    others with SIGKILL): its lock file, and the directory if the lock created it and nothing else is in it."""
    out = Path(output_dir)
    path = out / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails if a live run holds it: then it is that run's
        created = _holder(fd).get("created_dir", False)
        path.unlink()
        if created and not any(out.iterdir()):
            out.rmdir()
    except OSError:
        pass
    finally:
        os.close(fd)
