"""Offline mode for one ``datasets.load_dataset`` call, decided at call time.

``datasets`` and ``huggingface_hub`` read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, at import, into module constants
(``datasets.config``, ``huggingface_hub.constants``) that each request consults; without them an unreachable hub is
retried for ~25 s before the load gives up (data/hub.py decides whether the hub is reachable). Setting those
constants for the call, and putting them back after it, is the only way to decide later than the import. Outside the
datasets versions it was tested on, the load asks the network as datasets decides.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from . import applied, enabled


@contextmanager
def offline_mode(wanted: bool) -> Iterator[None]:
    """Set the offline flags that datasets and huggingface_hub consult per request, while inside."""
    if not wanted or not enabled("hub_offline"):
        yield
        return
    import datasets.config as dcfg
    import huggingface_hub.constants as hcfg

    saved = (dcfg.HF_HUB_OFFLINE, getattr(dcfg, "HF_DATASETS_OFFLINE", None), hcfg.HF_HUB_OFFLINE)
    dcfg.HF_HUB_OFFLINE = True
    if hasattr(dcfg, "HF_DATASETS_OFFLINE"):
        dcfg.HF_DATASETS_OFFLINE = True
    hcfg.HF_HUB_OFFLINE = True
    applied("hub_offline")
    try:
        yield
    finally:
        dcfg.HF_HUB_OFFLINE = saved[0]
        if saved[1] is not None:
            dcfg.HF_DATASETS_OFFLINE = saved[1]
        hcfg.HF_HUB_OFFLINE = saved[2]
