"""A DistributedSampler that a resumed run can seek, instead of replaying the DataLoader to where a checkpoint stopped."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class SeekableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler, plus `skip_next(n)`: the next pass starts at this rank's n-th index of the epoch.

    The indices are the parent's (same seed + epoch permutation, same drop_last trim, same rank split), so the tail it
    yields is exactly what an unseeked pass yields after n indices; only the skipped samples are never fetched or collated.
    `__len__` stays the whole epoch's: the trainer counts steps per epoch from len(loader) and walks from the resumed step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._skip = 0  # a seek belongs to the epoch it was set for: a new epoch starts at its first sample

    def skip_next(self, samples: int) -> None:
        """Start the next pass (only that one) `samples` indices into this rank's share of the epoch."""
        if not 0 <= samples <= self.num_samples:
            raise ValueError(f"cannot skip {samples} samples of an epoch of {self.num_samples} per rank")
        self._skip = samples

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0  # one-shot: a second pass over the same epoch is a whole one again
        return itertools.islice(super().__iter__(), skip, None)
