"""The Hugging Face hub, offline first: what a ``--model`` or ``--tokenizer`` name is (a preset, a local directory, a
GGUF file, a hub id) and loading a hub id from the local cache, online only when the hub is reachable and
``HF_HUB_OFFLINE`` is not set."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from . import gguf_files
from ..errors import UserError
from .presets import preset_list, resolve_preset, suggest_preset


# --------------------------------------------------------------------------------------------------
# Offline-first loading from the hub cache


_OFFLINE_HINT = (
    "download it on a login node (`hf download {name}` or "
    "`python -c \"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{name}')\"`) "
    "and point HF_HOME at that cache, pass a local directory, or use a preset such as tiny-gpt2, gpt2-medium"
)


def _offline_error(name: str, what: str = "model") -> UserError:
    return UserError(f"{what} {name!r} is not available offline", _OFFLINE_HINT.format(name=name))


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline_mode() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now (the libraries read them at import)."""
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - defensive
        return False


@functools.lru_cache(maxsize=8)
def _host_reachable(host: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_reachable() -> bool:
    """A quick TCP probe of the hub, so a machine with no network fails at once instead of after
    huggingface_hub's retries (~30 s). With a proxy configured the probe is skipped."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if not url.hostname:
        return True
    port = url.port or (443 if url.scheme == "https" else 80)
    return _host_reachable(url.hostname, port)


def remote_code_error(name: str) -> UserError:
    return UserError(
        f"{name!r} ships custom code and trust_remote_code is off",
        "set `trust_remote_code: true` (or --trust-remote-code) only if you trust that repository's code",
    )


def hub_load(loader: Callable[..., Any], name: str, what: str, **kwargs: Any) -> Any:
    """``loader(name, **kwargs)`` from the local cache, else online once, else the offline UserError."""
    try:
        return loader(name, local_files_only=True, **kwargs)
    except OSError:
        pass  # not in the cache (or not a valid repo id)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise remote_code_error(name) from None
        raise
    if not _offline_mode() and _hub_reachable():
        try:
            return loader(name, **kwargs)
        except ValueError as exc:
            if "trust_remote_code" in str(exc):
                raise remote_code_error(name) from None
            raise _offline_error(name, what) from exc
        except Exception as exc:  # network errors, 404s, gated repos...
            raise _offline_error(name, what) from exc
    raise _offline_error(name, what)


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith((".", "/", "~", os.sep))
        or name.endswith(("/", os.sep))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def classify(name: str, what: str = "model") -> tuple[str, Any]:
    """('preset', Preset) | ('dir', Path) | ('gguf', Path) | ('hub', name); UserError for typos and bad
    directories. A hub id with a packaged GGUF (``gguf_files.GGUF_PACKAGES``) that the HF cache does not hold is
    ('gguf', the package's file)."""
    preset = resolve_preset(name)
    if preset is not None:
        return "preset", preset
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return "gguf", path.resolve()
        if not path.is_dir():
            raise UserError(
                f"{what} path {name!r} is a file, not a directory",
                "pass the directory written by save_pretrained (it holds config.json), a .gguf file, a hub id or a preset",
            )
        return "dir", path
    suggestion = suggest_preset(name)
    if suggestion is not None:
        raise UserError(f"unknown {what} {name!r}; did you mean the preset {suggestion!r}?", f"use --model {suggestion}")
    if _looks_like_path(name) or name.lower().endswith(".gguf"):
        raise UserError(
            f"{what} {'file' if name.lower().endswith('.gguf') else 'directory'} {name!r} does not exist",
            f"check the path, or use a hub id (owner/name) or a preset ({preset_list()})",
        )
    if name in gguf_files.GGUF_PACKAGES and not gguf_files.in_hf_cache(name):
        try:
            return "gguf", gguf_files.packaged_gguf(name)
        except UserError:
            if _offline_mode() or not _hub_reachable():
                raise
    return "hub", name


