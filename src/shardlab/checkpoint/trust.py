"""A checkpoint that shardlab did not write for this user is screened before anything unpickles it, or refused.

Loading a checkpoint runs pickles, and a pickle can run any code: DeepSpeed's ``engine.load_checkpoint`` reads every
``*.pt`` of its folder with ``torch.load(weights_only=False)`` (its universal loader too), and DCP (dp, fsdp,
pipeline) unpickles ``.metadata`` with ``pickle.load`` and each non-tensor item (the optimizer's param_groups) with
``torch.load(weights_only=False)``. So before a run resumes from a checkpoint (``--resume``, checked in the launcher
before any worker starts) or ``shardlab export`` reads one:

- **written here** (``sealed``): every checkpoint shardlab saves carries a seal (``SEAL_FILE``), an HMAC-SHA256 under
  a key only this user can read (``checkpoint.key`` in shardlab's cache directory, mode 0600, made on first save) of
  a digest of every byte a loader unpickles (``pickle_digest``: the pickle of each torch file, DCP's metadata and its
  non-tensor items; not the tensor data, which loads as data). A seal that verifies says: shardlab wrote this under
  this user's key, and no pickle in it changed since. It loads as it is.
- **anything else** (another user's, downloaded, copied from a machine with another key, written by an older
  shardlab, changed after its seal) is screened (``screen``): each torch file is read with torch's weights-only
  unpickler (DeepSpeed's three classes allowed, as export reads them), DCP's metadata with an unpickler that builds
  only DCP's metadata dataclasses and a few torch types, and each non-tensor item weights-only. Nothing in them runs.
  A checkpoint that passes loads, said in one line; one that does not is refused in one line, naming the file and
  what it holds, unless ``--trust-checkpoint``.

Why a keyed seal: the output directory is not evidence (a downloaded run directory passed as ``--output-dir`` would be
"this run's"), nor an id in the checkpoint (whoever wrote the checkpoint wrote the id): a key the author of a foreign
checkpoint cannot know is. Out of scope: someone who can write into your run directory or read your key, and a file
changed between the check and the load.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import hmac
import importlib
import io
import json
import os
import pathlib
import pickle
import re
import secrets
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..cachedir import cache_root
from ..errors import UserError
from ..measure.records import write_text_atomic
from . import reshard

SEAL_FILE = "shardlab-seal.json"
KEY_FILE = "checkpoint.key"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")  # files torch.save writes (and torch.load reads)
DCP_METADATA = ".metadata"  # DCP's pickled index (also __RANK.metadata)
DS_PARTS = (reshard.DS_TAG, reshard.UNIVERSAL_DIR)  # folders whose files DeepSpeed reads (its classes allowed)


class Unscreenable(Exception):
    """A pickle the screen will not build: what it holds."""


# ---- the key and the seal --------------------------------------------------------------------------


def _key(create: bool) -> bytes | None:
    """This user's key (made with ``create`` when there is none); None when it cannot be read or made, or when others
    may read it (then it proves nothing)."""
    path = cache_root() / KEY_FILE
    for _ in range(2):
        try:
            if path.stat().st_mode & 0o077:
                return None
            return bytes.fromhex(path.read_text().strip())
        except FileNotFoundError:
            if not create:
                return None
        except (OSError, ValueError):
            return None
        try:  # written whole under another name, then linked into place: a concurrent maker's key wins, whole
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        except OSError:
            return None
    return None


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != SEAL_FILE)


def pickle_digest(directory: Path) -> str:
    """SHA-256 over every part of ``directory`` that a loader unpickles, by path: the pickle of each torch file (its
    ``data.pkl``; a legacy file whole), each DCP metadata file and the non-tensor items it indexes. Unscreenable
    when a DCP metadata file is not one the safe reader builds."""
    h = hashlib.sha256()
    for path in _files(directory):
        rel = path.relative_to(directory).as_posix()
        for name, data in _pickles(path):
            h.update(f"{rel}:{name}\0".encode())
            h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def _pickles(path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each pickle in ``path`` a loader reads; nothing for a file no loader unpickles."""
    if path.name.endswith(TORCH_SUFFIXES):
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for name in sorted(n for n in z.namelist() if n.endswith(".pkl")):
                    yield name, z.read(name)
        else:
            yield "", path.read_bytes()
    elif path.name.endswith(DCP_METADATA):
        raw = path.read_bytes()
        yield "", raw
        for where, data in _dcp_bytes_items(path, raw):
            yield where, data


def seal(directory: Path) -> bool:
    """Seal the checkpoint being written in ``directory`` (rank 0, once every rank's files are on disk); whether it
    could (no key where the cache directory is not writable: the checkpoint is then screened when read)."""
    key = _key(create=True)
    if key is None:
        return False
    mac = hmac.new(key, pickle_digest(directory).encode(), hashlib.sha256).hexdigest()
    write_text_atomic(directory / SEAL_FILE, json.dumps({"hmac_sha256": mac}))
    return True


def sealed_here(directory: Path) -> bool:
    """Whether ``directory`` carries a seal this user's key made, over the pickles it holds now."""
    key = _key(create=False)
    try:
        mac = json.loads((directory / SEAL_FILE).read_text())["hmac_sha256"]
        digest = pickle_digest(directory)
    except (OSError, ValueError, KeyError, TypeError, Unscreenable):
        return False
    return key is not None and isinstance(mac, str) and hmac.compare_digest(
        mac, hmac.new(key, digest.encode(), hashlib.sha256).hexdigest())


# ---- the screen ---------------------------------------------------------------------------------------


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: its dataclasses and enums, torch.Size, dtypes, layouts, memory formats,
    paths. Any other global (a function a pickle would call) is refused before it is looked up."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed.checkpoint.planner")

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            obj = torch.Size if name == "Size" else getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif (module, name) == ("torch.serialization", "_get_layout"):  # a lookup of torch's layouts by name
            return torch.serialization._get_layout
        elif module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return getattr(pathlib, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        elif module in self.MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise Unscreenable(f"a pickle that calls {module}.{name}")


def read_dcp_metadata(raw: bytes) -> Any:
    """DCP's Metadata from the bytes of a ``.metadata`` file, built by the safe unpickler (Unscreenable otherwise)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _DcpMetadataUnpickler(io.BytesIO(raw)).load()
    except Unscreenable:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or garbled file: not readable as DCP's metadata
        raise Unscreenable(f"no DCP metadata ({type(err).__name__})") from None
    if not isinstance(md, Metadata):
        raise Unscreenable(f"a {type(md).__name__}, not DCP metadata")
    return md


def _dcp_bytes_items(path: Path, raw: bytes) -> Iterator[tuple[str, bytes]]:
    """(where, bytes) of each non-tensor item the DCP metadata ``raw`` (of ``path``) indexes: what DCP's default
    planner reads with torch.load(weights_only=False)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = read_dcp_metadata(raw)
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise Unscreenable("DCP metadata without a file index")
    root = path.parent.resolve()
    for index, info in storage.items():
        if not isinstance(md.state_dict_metadata.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue
        rel, offset, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise Unscreenable("a DCP item without a file range")
        if getattr(info, "transform_descriptors", None):
            raise Unscreenable(f"a transformed (compressed) non-tensor item {index.fqn!r}")
        file = (root / rel).resolve()
        if not file.is_relative_to(root):
            raise Unscreenable(f"a DCP item outside its folder ({rel})")
        if not file.is_file():  # another node's file (nodes without a shared disk each keep their own): none to unpickle
            continue
        with open(file, "rb") as f:
            f.seek(offset)
            yield f"{rel}@{offset}", f.read(length)


def _load_weights_only(path: Path, deepspeed: bool) -> None:
    if deepspeed:
        reshard.load_deepspeed_file(path, mmap=zipfile.is_zipfile(path))  # DeepSpeed's three classes allowed
    else:
        torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))


def _why(err: Exception) -> str:
    """What a refused pickle holds, in a few words: the global that weights_only refused ('... GLOBAL posix.mkdir ...')
    or the screen's own words."""
    if isinstance(err, Unscreenable):
        return str(err)
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    if found:
        return f"a pickle that calls {found.group(1)}"
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"a file no weights-only load reads ({type(err).__name__}: {first[:120]})"


def screen(directory: Path) -> str | None:
    """The first pickle in ``directory`` that the weights-only readers refuse, as 'FILE holds WHAT'; None when every
    one holds only tensors and plain data. Nothing in the files runs."""
    for path in _files(directory):
        rel = path.relative_to(directory)
        try:
            if path.name.endswith(TORCH_SUFFIXES):
                _load_weights_only(path, deepspeed=bool(set(rel.parts[:-1]) & set(DS_PARTS)))
            elif path.name.endswith(DCP_METADATA):
                for where, data in _dcp_bytes_items(path, path.read_bytes()):
                    try:
                        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    except Exception as err:  # noqa: BLE001 - refused, said with where it is
                        raise Unscreenable(f"{_why(err)} (item {where})") from None
        except Exception as err:  # noqa: BLE001 - whatever the readers refuse, the load must not see
            return f"{rel.as_posix()} holds {_why(err)}"
    return None


# ---- the decision ---------------------------------------------------------------------------------------


_SCREENED: set[Path] = set()  # said once per process: `shardlab plan` runs the preflight once per strategy


def check_checkpoint(directory: Path, trusted: bool, what: str, say: Callable[[str], None] = print) -> str:
    """How the checkpoint ``directory`` may be read: 'trusted' (``--trust-checkpoint``), 'sealed' (written here) or
    'screened'; a UserError in one line when it holds a pickle the screen refuses. ``what``: the option that named it."""
    if trusted:
        return "trusted"
    if sealed_here(directory):
        return "sealed"
    problem = screen(directory)
    if problem is not None:
        raise UserError(f"{what}: checkpoint {str(directory)!r} was not written by shardlab for this user and {problem}, "
                        "which loading it would run",
                        "load only checkpoints you trust; if you trust this one, pass --trust-checkpoint")
    if directory.resolve() not in _SCREENED:
        _SCREENED.add(directory.resolve())
        say(f"checkpoint {directory} was not written by shardlab for this user: screened, its pickles hold only "
            "tensors and plain data")
    return "screened"
