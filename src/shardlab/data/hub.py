"""Hub datasets through ``datasets.load_dataset``, failing fast and in one line when offline.

Compute nodes often have no internet. ``datasets`` reads HF_HUB_OFFLINE /
HF_DATASETS_OFFLINE only at import, and without them it retries for ~25 s before
giving up. So the offline switches are re-read here at call time, and when neither is
set one short TCP probe decides; an unreachable hub turns offline mode on for this
load (compat/hub_offline.py; a dataset already in the local HF cache still loads).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from ..compat.hub_offline import offline_mode
from ..errors import UserError
from .rows import RawSplits

# Lazy imports below: datasets and huggingface_hub take seconds to import; only hub sources need them.

TRUE = {"1", "true", "yes", "on"}
EVAL_SPLITS = ("validation", "valid", "dev", "test")
PROBE_TIMEOUT_S = 3.0


def hub_target(source: str, hub_config: str | None) -> tuple[str, str | None]:
    """(dataset name, configuration) for load_dataset; wikitext names are configs of 'wikitext'."""
    if source == "wikitext":
        return "wikitext", hub_config or "wikitext-2-raw-v1"
    if source.startswith("wikitext-"):
        return "wikitext", hub_config or source
    return source, hub_config


def env_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable() -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _network_errors() -> tuple[type[BaseException], ...]:
    # OSError covers ConnectionError/OfflineModeIsEnabled, FileNotFoundError (DatasetNotFoundError,
    # LocalEntryNotFoundError) and HfHubHTTPError; the HTTP client's own errors may escape unwrapped.
    errors: list[type[BaseException]] = [OSError]
    for module, name in (("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def load_hub(source: str, hub_config: str | None) -> RawSplits:
    import datasets

    name, config = hub_target(source, hub_config)
    call = f"datasets.load_dataset({name!r}" + (f", {config!r})" if config else ")")
    offline = env_offline() or datasets.config.HF_HUB_OFFLINE or not hub_reachable()
    try:
        with offline_mode(offline):  # compat/hub_offline.py
            loaded = datasets.load_dataset(name, config)
    except ValueError as exc:
        text = str(exc)
        if "onfig name is missing" in text or "BuilderConfig" in text:
            first = text.strip().splitlines()[0]
            raise UserError(f"dataset {source!r} needs a configuration: {first}", "set dataset.hub_config") from None
        raise
    except _network_errors() as exc:
        if offline:
            raise UserError(
                f"dataset {source!r} is not available offline",
                f'on a login node with internet run `python -c "import datasets; {call}"` and point HF_HOME at '
                "that cache on the compute node, or use a local file / 'offline'",
            ) from None
        from datasets.exceptions import DatasetNotFoundError

        if isinstance(exc, DatasetNotFoundError):
            raise UserError(
                f"dataset {source!r} was not found on the Hugging Face Hub",
                "check the name (owner/name), log in with `hf auth login` if it is gated, or use a local file",
            ) from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"could not load dataset {source!r}: {first}", "check the network and the dataset name") from None

    if isinstance(loaded, datasets.Dataset):  # a single split
        return RawSplits(loaded, None, f"hub: {name}" + (f"/{config}" if config else ""))
    splits = list(loaded.keys())
    train_name = "train" if "train" in splits else splits[0]
    eval_name = next((s for s in EVAL_SPLITS if s in splits and s != train_name), None)
    desc = f"hub: {name}" + (f"/{config}" if config else "") + f" [{train_name}" + (f", eval={eval_name}]" if eval_name else "]")
    return RawSplits(loaded[train_name], loaded[eval_name] if eval_name else None, desc)
