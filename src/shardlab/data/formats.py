"""Rows -> text (lm or qa rendering) -> token ids, with the answer span for answer-only loss.

QA renders as ``Question: {q}\\nContext: {c}\\nAnswer: {a}`` + eos. The answer and the
context are located by character offsets from the fast tokenizer, so the ids are exactly
those of tokenizing the whole text at once (tokenizing pieces separately would change
tokens at the seams and differ from what the model sees at inference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import DatasetConfig
from ..errors import UserError
from .sources import rows_column, rows_columns

TOKENIZE_BATCH = 1000


@dataclass
class Rendered:
    texts: list[str]
    # qa only: char offset where the answer starts, and the context's char span (trimmable)
    answer_chars: list[int] | None = None
    context_spans: list[tuple[int, int]] | None = None
    skipped: int = 0  # rows without usable text / answer (misplaced ones included)
    misplaced: int = 0  # qa: rows skipped because no answer is where its answer_start says, in the context

    def head(self, n: int | None) -> "Rendered":
        if n is None or n >= len(self.texts):
            return self
        return Rendered(
            self.texts[:n],
            self.answer_chars[:n] if self.answer_chars is not None else None,
            self.context_spans[:n] if self.context_spans is not None else None,
            self.skipped,
            self.misplaced,
        )


@dataclass
class TokenizedExamples:
    ids: list[list[int]]  # one list per example, each ending with eos
    loss_start: list[int] | None = None  # qa: index of the first token that carries loss
    trim_spans: list[tuple[int, int]] | None = None  # qa: context tokens that truncation may drop
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


# ---- rendering -----------------------------------------------------------------------------------


def render(rows: Any, ds: DatasetConfig, where: str) -> Rendered:
    if len(rows) == 0:  # no rows, no columns to complain about: the caller reports "no examples"
        return Rendered([])
    return render_qa(rows, where) if ds.format == "qa" else render_lm(rows, ds.text_field or "text", where)


def render_lm(rows: Any, text_field: str, where: str) -> Rendered:
    columns = rows_columns(rows)
    if text_field not in columns:
        raise UserError(
            f"{where} has no {text_field!r} column (columns: {', '.join(columns) or 'none'})",
            "set dataset.text_field to the column that holds the text",
        )
    values = rows_column(rows, text_field)
    texts = [v for v in values if isinstance(v, str) and v.strip()]
    return Rendered(texts, skipped=len(values) - len(texts))


def _answer_candidates(value: Any) -> list[tuple[str, Any]]:
    """(text, answer_start or None) of every non-empty answer in a plain string, a list of strings, SQuAD's
    ``{"text": [...], "answer_start": [...]}`` (the hub's layout) or ``[{"text": ..., "answer_start": ...}]`` (its JSON)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [(value, None)] if value.strip() else []
    if isinstance(value, dict):
        texts, starts = value.get("text"), value.get("answer_start")
        if isinstance(texts, (list, tuple)):
            starts = list(starts) if isinstance(starts, (list, tuple)) else []
            return [(t, starts[i] if i < len(starts) else None) for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
        return [(t, starts) for t, _ in _answer_candidates(texts)]
    if isinstance(value, (list, tuple)):
        return [c for item in value for c in _answer_candidates(item)]
    return [(str(value), None)]


def _answer_in_context(value: Any, context: str) -> tuple[str | None, bool]:
    """The first answer that is where its answer_start says (or has none), and whether some answer was misplaced:
    an answer_start outside the context, or one where the context holds other text (an edited context, an offset
    counted in bytes or off by one)."""
    misplaced = False
    for text, start in _answer_candidates(value):
        if start is None:
            return text, False
        if isinstance(start, int) and not isinstance(start, bool) and 0 <= start and context[start : start + len(text)] == text:
            return text, False
        misplaced = True
    return None, misplaced


def render_qa(rows: Any, where: str) -> Rendered:
    columns = rows_columns(rows)
    answer_col = "answer" if "answer" in columns else "answers" if "answers" in columns else None
    missing = [f for f in ("question", "context") if f not in columns] + ([] if answer_col else ["answer"])
    if missing:
        raise UserError(
            f"QA data in {where} lacks field(s) {', '.join(missing)} (columns: {', '.join(columns) or 'none'})",
            "provide question/context/answer columns or use --format lm",
        )
    assert answer_col is not None
    questions, contexts = rows_column(rows, "question"), rows_column(rows, "context")
    answers = rows_column(rows, answer_col)
    texts, answer_chars, spans = [], [], []
    misplaced = 0
    for q, c, a in zip(questions, contexts, answers):
        c = c if isinstance(c, str) else ""
        answer, wrong_place = _answer_in_context(a, c)
        misplaced += wrong_place
        if not answer or not isinstance(q, str) or not q.strip():
            continue  # e.g. SQuAD v2's unanswerable questions: nothing to learn from
        head = f"Question: {q}\nContext: "
        prompt = f"{head}{c}\nAnswer: "
        texts.append(prompt + answer)
        answer_chars.append(len(prompt))
        spans.append((len(head), len(head) + len(c)))
    return Rendered(texts, answer_chars, spans, skipped=len(questions) - len(texts), misplaced=misplaced)


# ---- tokenization --------------------------------------------------------------------------------


def eos_id(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos token",
            "use a causal-LM tokenizer, or set tokenizer.eos_token before building the data",
        )
    return int(eos)


def _appends_eos(tokenizer: Any, eos: int) -> bool:
    # Some tokenizers (e.g. with add_eos_token) already end every encoding with eos.
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(probe) and probe[-1] == eos


def tokenize(rendered: Rendered, tokenizer: Any, *, answer_only: bool) -> TokenizedExamples:
    """Batch-tokenize the texts (no truncation: packing needs whole documents) and append eos.

    QA with ``answer_only``: loss from each answer's first token on; without it, loss on every token (question and
    context too). Either way the context span is kept, so that padding truncates the context, not the answer."""
    tok = _tokenize(rendered, tokenizer)
    if not answer_only:
        tok.loss_start = None
    return tok


def _tokenize(rendered: Rendered, tokenizer: Any) -> TokenizedExamples:
    eos = eos_id(tokenizer)
    add_eos = not _appends_eos(tokenizer, eos)
    qa = rendered.answer_chars is not None
    if qa and not getattr(tokenizer, "is_fast", False):
        return _tokenize_qa_in_pieces(rendered, tokenizer, eos, add_eos)

    ids: list[list[int]] = []
    loss_start: list[int] = []
    trim_spans: list[tuple[int, int]] = []
    texts = rendered.texts
    for lo in range(0, len(texts), TOKENIZE_BATCH):
        # verbose=False: no "sequence longer than the maximum" warning; blocks cut to seq_len later
        enc = tokenizer(
            texts[lo : lo + TOKENIZE_BATCH],
            add_special_tokens=True,
            return_attention_mask=False,
            return_offsets_mapping=qa,
            verbose=False,
        )
        batch_ids = enc["input_ids"]
        if add_eos:
            for seq in batch_ids:
                seq.append(eos)
        ids.extend(batch_ids)
        if qa:
            assert rendered.answer_chars is not None and rendered.context_spans is not None
            for j, offsets in enumerate(enc["offset_mapping"]):
                off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
                starts, ends = off[:, 0], off[:, 1]
                special = (starts == 0) & (ends == 0)
                ans_char = rendered.answer_chars[lo + j]
                c0, c1 = rendered.context_spans[lo + j]
                # first token reaching into the answer (the " Paris" token that carries its space)
                in_answer = np.flatnonzero((ends > ans_char) & ~special)
                loss_start.append(int(in_answer[0]) if in_answer.size else len(batch_ids[j]) - 1)
                first_ctx = np.flatnonzero((starts >= c0) & ~special)
                after_ctx = np.flatnonzero((starts >= c1) & ~special)
                t0 = int(first_ctx[0]) if first_ctx.size else 0
                t1 = int(after_ctx[0]) if after_ctx.size else t0
                trim_spans.append((t0, max(t0, t1)))
    lengths = np.fromiter((len(s) for s in ids), dtype=np.int64, count=len(ids))
    return TokenizedExamples(ids, loss_start if qa else None, trim_spans if qa else None, lengths)


def _tokenize_qa_in_pieces(rendered: Rendered, tokenizer: Any, eos: int, add_eos: bool) -> TokenizedExamples:
    """Fallback for tokenizers without offsets: tokenize head / context / prompt tail / answer apart.

    Pieces split before a space so word-initial tokens stay the same for byte-level BPEs.
    """
    assert rendered.answer_chars is not None and rendered.context_spans is not None
    heads, ctxs, mids, answers = [], [], [], []
    for text, a, (c0, c1) in zip(rendered.texts, rendered.answer_chars, rendered.context_spans):
        heads.append(text[: c0 - 1])  # "Question: q\nContext:"
        ctxs.append(text[c0 - 1 : c1])  # " context"
        mids.append(text[c1 : a - 1])  # "\nAnswer:"
        answers.append(text[a - 1 :])  # " answer"

    def enc(parts: list[str], special: bool) -> list[list[int]]:
        return tokenizer(parts, add_special_tokens=special, return_attention_mask=False, verbose=False)["input_ids"]

    ids, loss_start, trim_spans = [], [], []
    for h, c, m, a in zip(enc(heads, True), enc(ctxs, False), enc(mids, False), enc(answers, False)):
        seq = h + c + m + a + ([eos] if add_eos else [])
        ids.append(seq)
        trim_spans.append((len(h), len(h) + len(c)))
        loss_start.append(len(h) + len(c) + len(m))
    lengths = np.fromiter((len(s) for s in ids), dtype=np.int64, count=len(ids))
    return TokenizedExamples(ids, loss_start, trim_spans, lengths)
