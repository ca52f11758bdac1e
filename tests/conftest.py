"""Shared test setup: offline hub, per-session caches, and `shardlab train` as a subprocess.

Every training run is its own `python -m shardlab train` process, so DeepSpeed's and
torch.distributed's global state (process groups, accelerator choice, JIT ops) can never
leak from one test into the next.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import yaml

# A training run is seconds on CPU; this is only a guard against a hung collective.
RUN_TIMEOUT_S = 420


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory):
    """No network, and every cache (tokenized blocks, HF datasets Arrow files) in this session's tmp dir."""
    base = tmp_path_factory.mktemp("env")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("SHARDLAB_CACHE", str(base / "shardlab-cache"))
        mp.setenv("HF_DATASETS_CACHE", str(base / "hf-datasets"))
        try:  # the in-process side (datasets reads the variable at import)
            import datasets.config

            mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(base / "hf-datasets"))
        except ImportError:  # pragma: no cover
            pass
        yield base


@dataclass
class TrainRun:
    """One finished `shardlab train` invocation and what it left in its run directory."""

    out: Path
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> "TrainRun":
        assert self.returncode == 0, f"shardlab train {' '.join(self.args)} exited {self.returncode}:\n{self.stderr[-8000:]}"
        return self

    @property
    def all_rows(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Training rows (one per logged step), without eval and epoch-summary rows."""
        return [r for r in self.all_rows if "loss" in r]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    @cached_property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    @cached_property
    def config(self) -> dict[str, Any]:
        return yaml.safe_load((self.out / "config.yaml").read_text())


def shardlab_train(args: list[str], out: Path | None, timeout: float = RUN_TIMEOUT_S) -> TrainRun:
    """`python -m shardlab train ARGS --output-dir OUT` in a fresh process."""
    full = ["train", *args] + (["--output-dir", str(out)] if out is not None else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "shardlab", *full],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    return TrainRun(Path(out) if out is not None else Path(), args, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def train_cli():
    return shardlab_train


def eval_loss_like_the_trainer(model, dataset, world: int) -> float:
    """Token-weighted mean loss over the blocks DistributedSampler(drop_last=False) gives `world` ranks."""
    import torch

    n = len(dataset)
    indices = list(range(n)) + list(range(n))[: math.ceil(n / world) * world - n]
    total = tokens = 0.0
    with torch.no_grad():
        for i in indices:
            batch = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
            n_tok = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss.double()) * n_tok
            tokens += n_tok
    return total / tokens


@pytest.fixture(scope="session")
def trainer_eval_loss():
    """`eval_loss_like_the_trainer`: what an exported model's eval loss must reproduce."""
    return eval_loss_like_the_trainer
