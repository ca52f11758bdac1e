"""The micro-batches of one optimizer step, fetched together so that the step's loss can weigh tokens.

transformers' Trainer (>= 4.46) divides the summed token losses of a step by the step's count of label tokens, over
all its micro-batches and ranks; a mean per micro-batch would count a micro-batch of 10 answer tokens as much as one of
500. That count must be known before the first micro-batch's backward, so a step's micro-batches are collated and
counted up front (on the CPU: no device sync), then copied to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.blocks import IGNORE


def label_tokens(labels: torch.Tensor) -> int:
    """Positions a causal LM's loss counts: labels after the shift by one (token t predicts t+1) that are not IGNORE."""
    return int((labels[..., 1:] != IGNORE).sum())


def without_trivial_mask(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """Drop an all-ones attention mask (packed data) and count non-pad tokens, on the CPU.

    An all-ones mask can make transformers build an explicit 4-D mask (or check the mask on the
    GPU), keeping SDPA off its fused `is_causal` kernels; the bare loops we compare with pass
    no mask either. Counting on the CPU avoids a GPU sync.
    """
    mask = batch["attention_mask"]
    n_useful = int(mask.sum())
    if n_useful == mask.numel():
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch, n_useful


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class Micro:
    batch: dict[str, torch.Tensor]  # on the device
    useful: int  # non-pad tokens
    labels: int  # label tokens (label_tokens)


@dataclass
class StepBatches:
    """The micro-batches of one optimizer step on this rank."""

    micros: list[Micro]

    @property
    def label_tokens(self) -> int:
        return sum(m.labels for m in self.micros)

    @property
    def useful(self) -> int:
        return sum(m.useful for m in self.micros)


class DevicePrefetcher:
    """Wraps a batch iterator: yields StepBatches of `accum` micro-batches. `preload()` fetches, collates, counts and
    copies the next step's batches to the device (non-blocking, from pinned memory) while the device is still busy with
    this step, as nanoGPT does for its next batch; it does nothing once they are loaded."""

    _END = object()

    def __init__(self, iterator, device: torch.device, accum: int):
        self.iterator, self.device, self.accum, self._next = iterator, device, accum, None

    def preload(self) -> None:
        if self._next is not None:
            return
        micros = []
        try:
            for _ in range(self.accum):
                batch, n_useful = without_trivial_mask(next(self.iterator))
                micros.append(Micro(to_device(batch, self.device), n_useful, label_tokens(batch["labels"])))
            self._next = StepBatches(micros)
        except StopIteration:  # a partial step at the end of an epoch is never trained (steps_per_epoch drops it)
            self._next = self._END

    def __iter__(self):
        return self

    def __next__(self) -> StepBatches:
        self.preload()
        item, self._next = self._next, None
        if item is self._END:
            raise StopIteration
        return item
