"""The eval split's loss, token-weighted over all ranks: what the loop's evaluations (before training, every
--eval-every steps, at each epoch's end) record."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..data.blocks import IGNORE
from ..measure import metrics
from ..runtime.distributed import DistEnv
from ..training.batches import to_device, without_trivial_mask


@torch.no_grad()
def evaluate(strategy, loader: DataLoader, env: DistEnv) -> dict[str, float]:
    """Token-weighted mean loss over the eval split, across all ranks."""
    strategy.eval()
    t0 = time.perf_counter()
    totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss*tokens, tokens, samples
    for batch in loader:
        batch = to_device(without_trivial_mask(batch)[0], env.device)
        loss = strategy.forward(batch)
        # HF averages over predicted positions: labels != IGNORE after the shift by one.
        n_tok = (batch["labels"][:, 1:] != IGNORE).sum()
        totals += torch.stack([loss.double() * n_tok, n_tok.double(), torch.tensor(len(batch["input_ids"]), device=env.device, dtype=torch.float64)])
    if env.is_distributed:
        dist.all_reduce(totals)
    metrics.sync(env.device)
    dt = time.perf_counter() - t0
    strategy.train()
    if totals[1].item() == 0:  # fewer eval samples than one eval batch (pipeline: micro x micro-batches)
        return {}
    loss = (totals[0] / totals[1]).item()
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50)), "eval_time_s": dt, "eval_samples_per_s": totals[2].item() / dt if dt else 0.0}
