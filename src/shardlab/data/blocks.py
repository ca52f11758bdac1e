"""Token ids -> fixed-length training blocks: packing or padding; and the Dataset that serves them.

Labels equal input_ids (HF causal LMs shift them internally), with -100 where no loss
is wanted: pads, and with answer-only loss everything before the answer. Blocks with no
loss position at all are dropped, since a batch of them makes the mean loss NaN.

Blocks are stored as int32 (half the memory and cache size); items come out as int64.
``labels`` None means "same as input_ids", ``attention_mask`` None means "all ones".
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from .formats import TokenizedExamples

IGNORE = -100


@dataclass
class Blocks:
    input_ids: torch.Tensor  # [n, seq_len] int32
    labels: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    truncated: int = 0  # pad mode: examples cut to seq_len
    dropped: int = 0  # blocks without any loss position
    dropped_tail_tokens: int = 0  # pack mode: the ragged remainder

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def useful_tokens(self) -> int:
        return len(self) * self.seq_len if self.attention_mask is None else int(self.attention_mask.sum())

    def loss_tokens(self) -> int:
        if self.labels is None:
            return self.useful_tokens()
        return int((self.labels != IGNORE).sum())

    def state(self) -> dict[str, Any]:
        """Plain tensors only, so torch.load(weights_only=True) can read the cache back."""
        return {"input_ids": self.input_ids, "labels": self.labels, "attention_mask": self.attention_mask}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Blocks":
        return cls(state["input_ids"], state.get("labels"), state.get("attention_mask"))


class BlockDataset(torch.utils.data.Dataset):
    """Item i -> {input_ids, labels, attention_mask}, each a LongTensor[seq_len]."""

    def __init__(self, blocks: Blocks):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        b = self.blocks
        ids = b.input_ids[i].long()
        labels = ids.clone() if b.labels is None else b.labels[i].long()
        mask = torch.ones_like(ids) if b.attention_mask is None else b.attention_mask[i].long()
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _loss_flags(lengths: np.ndarray, starts: list[int]) -> np.ndarray:
    """Concatenated per-token flags: True from each example's loss start to its end."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # +1 at each example's loss start, -1 at its end; a running sum marks the loss spans.
    marks = np.zeros(int(offsets[-1]) + 1, dtype=np.int64)
    np.add.at(marks, offsets[:-1] + np.minimum(np.asarray(starts, dtype=np.int64), lengths), 1)
    np.add.at(marks, offsets[1:], -1)
    return np.cumsum(marks)[:-1] > 0


def pack(tok: TokenizedExamples, seq_len: int, pad_id: int) -> Blocks:
    """Concatenate all examples (each already ending in eos) and cut full seq_len blocks.

    The ragged tail is dropped, unless the data is shorter than one block: then it becomes
    one padded block, so a tiny smoke-test file still trains.
    """
    total = int(tok.lengths.sum())
    flat = np.fromiter(chain.from_iterable(tok.ids), dtype=np.int32, count=total)
    loss = _loss_flags(tok.lengths, tok.loss_start) if tok.loss_start is not None else None
    n_full = total // seq_len
    if n_full == 0 and total > 0:
        ids = np.full((1, seq_len), pad_id, dtype=np.int32)
        ids[0, :total] = flat
        mask = np.zeros((1, seq_len), dtype=np.int32)
        mask[0, :total] = 1
        keep = np.zeros((1, seq_len), dtype=bool)
        keep[0, :total] = True if loss is None else loss
        labels = np.where(keep, ids, IGNORE).astype(np.int32)
        return _finish(ids, labels, mask, dropped_tail=0)
    used = n_full * seq_len
    ids = flat[:used].reshape(n_full, seq_len)
    labels = None if loss is None else np.where(loss[:used].reshape(n_full, seq_len), ids, IGNORE).astype(np.int32)
    return _finish(ids, labels, None, dropped_tail=total - used)


def pad(tok: TokenizedExamples, seq_len: int, pad_id: int) -> Blocks:
    """One block per example: truncated or padded to seq_len; pads masked out of attention and loss.

    QA examples that are too long lose the end of their context rather than the answer.
    """
    n = len(tok.ids)
    ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.int32)
    keep = np.zeros((n, seq_len), dtype=bool)
    truncated = 0
    for i, seq in enumerate(tok.ids):
        start = tok.loss_start[i] if tok.loss_start is not None else 0
        if len(seq) > seq_len:
            truncated += 1
            seq, start = _truncate(seq, start, seq_len, tok.trim_spans[i] if tok.trim_spans is not None else None)
        length = len(seq)
        ids[i, :length] = seq
        mask[i, :length] = 1
        keep[i, min(start, length) : length] = True
    labels = np.where(keep, ids, IGNORE).astype(np.int32)
    blocks = _finish(ids, labels, mask, dropped_tail=0)
    blocks.truncated = truncated
    return blocks


def _truncate(seq: list[int], start: int, seq_len: int, span: tuple[int, int] | None) -> tuple[list[int], int]:
    excess = len(seq) - seq_len
    if span is not None and span[1] - span[0] >= excess:
        cut = span[1] - excess
        new_start = start - excess if start >= span[1] else start
        return seq[:cut] + seq[span[1] :], new_start
    return seq[:seq_len], start


def _finish(ids: np.ndarray, labels: np.ndarray | None, mask: np.ndarray | None, dropped_tail: int) -> Blocks:
    dropped = 0
    if labels is not None:
        has_loss = (labels != IGNORE).any(axis=1)
        dropped = int((~has_loss).sum())
        if dropped:
            ids, labels = ids[has_loss], labels[has_loss]
            mask = mask[has_loss] if mask is not None else None
    if mask is not None and mask.all():
        mask = None  # nothing padded: store nothing
    if labels is not None and mask is None and np.array_equal(labels, ids):
        labels = None
    return Blocks(
        torch.from_numpy(np.ascontiguousarray(ids)),
        torch.from_numpy(np.ascontiguousarray(labels)) if labels is not None else None,
        torch.from_numpy(np.ascontiguousarray(mask)) if mask is not None else None,
        dropped=dropped,
        dropped_tail_tokens=dropped_tail,
    )


def blocks_from_tokens(tokens: torch.Tensor, seq_len: int) -> Blocks:
    """A flat token stream (synthetic data) cut into full blocks."""
    n_full = tokens.numel() // seq_len
    ids = tokens[: n_full * seq_len].to(torch.int32).reshape(n_full, seq_len).contiguous()
    return Blocks(ids, dropped_tail_tokens=int(tokens.numel() - n_full * seq_len))


def select_blocks(blocks: Blocks, index: list[int]) -> Blocks:
    idx = torch.as_tensor(index, dtype=torch.long)
    pick = lambda t: None if t is None else t[idx].contiguous()  # noqa: E731
    return Blocks(pick(blocks.input_ids), pick(blocks.labels), pick(blocks.attention_mask))
