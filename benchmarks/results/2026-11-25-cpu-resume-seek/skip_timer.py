"""Time a resume's start of epoch: the old replay (collate every batch before the checkpointed step, discard it)
against the seeking sampler, on the real offline corpus and the trainer's own DataLoader, and check both give the
same next batches. Usage: python skip_timer.py [seq_len] [micro] [accum]"""

import sys
import time
from types import SimpleNamespace

import torch

from shardlab.config import RunConfig
from shardlab.data import build_datasets
from shardlab.training.tokenizing import load_tokenizer
from shardlab.training.trainer import Trainer

seq_len, micro, accum = (int(a) for a in (sys.argv[1:] + ["16", "1", "1"][len(sys.argv) - 1:]))
cfg = RunConfig(model="tiny-gpt2", seq_len=seq_len, seed=1234)
splits = build_datasets(cfg.dataset, load_tokenizer(cfg), seq_len, cfg.seed)
stand_in = SimpleNamespace(dp_size=1, dp_rank=0, micro=micro, accum=accum, device_type="cpu", cfg=SimpleNamespace(seed=cfg.seed))


def loader():
    train, sampler, _ = Trainer._loaders(stand_in, SimpleNamespace(train=splits.train, eval=None))
    sampler.set_epoch(0)
    return train, sampler


steps = len(loader()[0]) // accum
skip = steps - 1  # a checkpoint at the last step but one of the epoch
print(f"{len(splits.train)} train blocks of {seq_len} tokens, micro {micro} x accum {accum}: {steps} steps per epoch; resume at step {skip}")

train, _ = loader()
t0 = time.perf_counter()
batches = iter(train)
for _ in range(skip * accum):  # the replay resume did before
    next(batches)
old_next = next(batches)
replay = time.perf_counter() - t0

train, sampler = loader()
t0 = time.perf_counter()
sampler.skip_next(skip * accum * micro)
new_next = next(iter(train))
seek = time.perf_counter() - t0

assert all(torch.equal(old_next[k], new_next[k]) for k in old_next), "the first resumed batch differs"
print(f"replay: {replay:.3f} s to the first resumed batch; seek: {seek * 1000:.2f} ms; same batch: yes")
