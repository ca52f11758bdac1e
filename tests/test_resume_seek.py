"""Resume seeks the training sampler: the batches after a resume are an uninterrupted run's, and no skipped one is built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from shardlab.training.sampling import SeekableDistributedSampler
from shardlab.loop.trainer import Trainer


class CountingBlocks(Dataset):
    """Token blocks like the real training set's, counting every fetch (each is collated into a batch)."""

    def __init__(self, n: int, seq_len: int = 4):
        self.n, self.seq_len, self.fetched = n, seq_len, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched.append(i)
        ids = torch.arange(i * self.seq_len, (i + 1) * self.seq_len)
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n", "world"), [(37, 1), (37, 2), (40, 4), (23, 3)])
def test_seeking_yields_the_tail_of_the_epochs_order(n, world, shuffle, drop_last):
    data = range(n)
    for rank in range(world):
        for epoch in (0, 3):
            plain = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            plain.set_epoch(epoch)
            full = list(plain)
            seeking = SeekableDistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            for skip in (0, 1, 5, len(full) - 1, len(full)):
                seeking.set_epoch(epoch)
                seeking.skip_next(skip)
                assert list(seeking) == full[skip:], (rank, epoch, skip)
                assert len(seeking) == len(full)  # the epoch's length, which the trainer counts steps from


def test_a_seek_applies_to_one_pass_of_one_epoch():
    sampler = SeekableDistributedSampler(range(20), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(0)
    whole = list(sampler)
    sampler.skip_next(6)
    assert list(sampler) == whole[6:]
    assert list(sampler) == whole  # the next pass over the same epoch is whole again
    sampler.skip_next(6)
    sampler.set_epoch(1)  # a later epoch starts at its first sample
    assert len(list(sampler)) == 20
    with pytest.raises(ValueError, match="cannot skip 21"):
        sampler.skip_next(21)


def trainer_loader(data, dp_size: int, dp_rank: int, micro: int, accum: int):
    """The trainer's own training DataLoader and sampler (Trainer._loaders), for a stand-in trainer without a model."""
    fake = SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank, micro=micro, accum=accum, device_type="cpu", cfg=SimpleNamespace(seed=5))
    train, sampler, evl = Trainer._loaders(fake, SimpleNamespace(train=data, eval=None))
    assert evl is None
    return train, sampler


def batches(loader, sampler, epoch: int, skip_samples: int = 0) -> list[torch.Tensor]:
    sampler.set_epoch(epoch)
    sampler.skip_next(skip_samples)
    return [b["input_ids"] for b in loader]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("dp_size", "micro", "accum"), [(1, 2, 3), (2, 3, 2), (3, 1, 1)])
def test_a_resumed_epoch_gets_the_batches_of_an_uninterrupted_one(dp_size, micro, accum):
    data = CountingBlocks(101)
    for rank in range(dp_size):
        for epoch in (0, 2):
            steps = len(trainer_loader(data, dp_size, rank, micro, accum)[0]) // accum
            for skip in (1, steps // 2, steps - 1):  # optimizer steps done in this epoch when the checkpoint was written
                straight_loader, straight_sampler = trainer_loader(data, dp_size, rank, micro, accum)
                loader, sampler = trainer_loader(data, dp_size, rank, micro, accum)
                straight = batches(straight_loader, straight_sampler, epoch)
                assert len(straight) == len(straight_loader) > skip * accum
                assert same(batches(loader, sampler, epoch, skip * accum * micro), straight[skip * accum:])
                # one generator draw per iter(), as in an uninterrupted run: nothing downstream sees a difference
                assert torch.equal(loader.generator.get_state(), straight_loader.generator.get_state())
                # the next epoch is a whole one
                assert same(batches(loader, sampler, epoch + 1), batches(straight_loader, straight_sampler, epoch + 1))


def test_no_skipped_batch_is_fetched():
    data = CountingBlocks(200)
    micro, accum, skip = 2, 4, 20  # resume at step 20 of 25: 160 of 200 samples behind
    loader, sampler = trainer_loader(data, 1, 0, micro, accum)
    sampler.set_epoch(0)
    order = list(sampler)
    sampler.skip_next(skip * accum * micro)
    first = next(iter(loader))
    assert data.fetched == order[160:162]  # only the first resumed batch's two samples
    assert first["input_ids"].shape == (micro, data.seq_len)
