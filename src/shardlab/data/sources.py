"""Raw examples from a source: the offline corpus, a local file or directory, or a hub dataset.

A source yields ``RawSplits``: training rows and, when the source has its own
validation/test split, eval rows. Rows are a ``list[dict]`` or a ``datasets.Dataset``;
``rows_columns`` / ``rows_column`` / ``rows_select`` read both alike.
Synthetic data has no rows; ``build_datasets`` makes its tokens directly.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DatasetConfig
from ..errors import UserError
from .rows import RawSplits, Rows
from .hub import load_hub

# Lazy imports below: datasets only for the sources that read through it; pydoc_data.topics (Python's 0.7 MB help
# text, the offline corpus) only for the offline source.

TEXT_SUFFIXES = (".txt", ".text", ".md")
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED = ", ".join([*TEXT_SUFFIXES, *RECORD_SUFFIXES])
# File-name words marking a held-out split in a directory (e.g. wiki.valid.txt, squad-dev.json).
EVAL_WORDS = ("validation", "valid", "val", "dev", "eval")
TEST_WORDS = ("test",)
# A text file whose characters are more than this share undecodable (U+FFFD once read as UTF-8) or control characters is
# not text: random or binary bytes (and UTF-16) come to about half, a Latin-1 file read as UTF-8 to its share of accented
# letters (a few percent in French or German prose), which is read on with those letters replaced.
MAX_UNREADABLE_SHARE = 0.25
_UNREADABLE = re.compile("[\x00-\x08\x0e-\x1f\x7f\ufffd]")

@dataclass(frozen=True)
class Source:
    kind: str  # "offline" | "synthetic" | "file" | "hub"
    name: str  # the source string as given
    path: Path | None = None


# ---- rows helpers ----------------------------------------------------------------------------------


def rows_len(rows: Rows) -> int:
    return len(rows)


def rows_columns(rows: Rows) -> list[str]:
    if hasattr(rows, "column_names"):
        return list(rows.column_names)
    seen: dict[str, None] = {}
    for row in rows[:100]:  # records may be ragged; the first ones tell the layout
        seen.update(dict.fromkeys(row))
    return list(seen)


def rows_column(rows: Rows, name: str) -> list:
    if hasattr(rows, "column_names"):
        return list(rows[name])
    return [row.get(name) for row in rows]


def rows_select(rows: Rows, indices: list[int]) -> Rows:
    if hasattr(rows, "select"):
        return rows.select(indices)
    return [rows[i] for i in indices]


# ---- classification ------------------------------------------------------------------------------


def classify(ds: DatasetConfig) -> Source:
    """Decide what kind of source ``ds.source`` names; a missing local path is a UserError."""
    name = ds.source.strip()
    if name == "offline":
        return Source("offline", name)
    if name == "synthetic":
        return Source("synthetic", name)
    path = Path(name).expanduser()
    if path.exists():
        return Source("file", name, path.resolve())
    if _looks_like_path(name):
        raise UserError(
            f"dataset path {name!r} does not exist",
            "check the path, or use 'offline', 'synthetic' or a hub name such as wikitext-2-raw-v1",
        )
    return Source("hub", name)


def _looks_like_path(name: str) -> bool:
    if name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name:
        return True
    if name.lower().endswith((*TEXT_SUFFIXES, *RECORD_SUFFIXES, ".gz")):
        return True
    # Hub ids are at most owner/name; deeper paths are local.
    return name.count("/") > 1


def fingerprint(src: Source) -> Any:
    """Cheap identity of the source's content for the cache key (no full reads of large files)."""
    if src.kind == "offline":
        from pydoc_data.topics import topics

        digest = hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()
        return {"offline": digest}
    if src.kind == "file":
        assert src.path is not None
        files = [src.path] if src.path.is_file() else _list_files(src.path)
        return {"files": [[str(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in files]}
    return {src.kind: src.name}


# ---- loading -------------------------------------------------------------------------------------


def load_rows(src: Source, ds: DatasetConfig) -> RawSplits:
    if src.kind == "offline":
        return _load_offline()
    if src.kind == "file":
        assert src.path is not None
        return _load_local(src.path)
    if src.kind == "hub":
        return load_hub(src.name, ds.hub_config)
    raise AssertionError(f"no rows for source kind {src.kind}")


def _load_offline() -> RawSplits:
    """CPython's pydoc help topics (~0.5 MB of English prose and code), grouped into records.

    Paragraphs alone are often one-line headings or code fragments; grouping neighbours up to
    ~1000 characters keeps each record a coherent passage and still gives hundreds of them.
    """
    from pydoc_data.topics import topics

    records = []
    for key in sorted(topics):
        for chunk in _group_paragraphs(_paragraphs(topics[key]), max_chars=1000):
            records.append({"text": chunk})
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return RawSplits(records, None, f"offline: CPython {version} pydoc topics ({len(topics)} topics)")


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def _group_paragraphs(paragraphs: list[str], max_chars: int) -> list[str]:
    groups: list[str] = []
    current: list[str] = []
    size = 0
    for para in paragraphs:
        if current and size + len(para) > max_chars:
            groups.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        groups.append("\n\n".join(current))
    return groups


def _text_examples(text: str) -> list[str]:
    """Paragraphs when the text has blank lines, else its non-empty lines."""
    if re.search(r"\n\s*\n", text):
        return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [line.strip() for line in text.splitlines() if line.strip()]


def _list_files(directory: Path) -> list[Path]:
    suffixes = (*TEXT_SUFFIXES, *RECORD_SUFFIXES)
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and p.suffix.lower() in suffixes and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in RECORD_SUFFIXES:
        return RECORD_SUFFIXES[suffix]
    raise UserError(f"unsupported dataset file type {suffix or '(none)'!r} for {str(path)!r}", f"use one of {SUPPORTED}")


def _split_role(path: Path, root: Path) -> str:
    # words of the file name and of its folders below the dataset root (data/validation/*.txt)
    words = set(re.split(r"[-_.\s]+", path.stem.lower()))
    words |= {part.lower() for part in path.relative_to(root).parts[:-1]}
    if words & set(EVAL_WORDS):
        return "eval"
    if words & set(TEST_WORDS):
        return "test"
    return "train"


def _load_local(path: Path) -> RawSplits:
    if path.is_file():
        kind = _kind(path)
        if path.stat().st_size == 0:
            raise UserError(f"dataset file {str(path)!r} is empty", "point dataset.source at a file with examples")
        return RawSplits(_read_files(kind, [path]), None, f"file: {path}")

    files = _list_files(path)
    if not files:
        raise UserError(f"dataset directory {str(path)!r} holds no usable files", f"put files of type {SUPPORTED} in it")
    kinds = {_kind(f) for f in files}
    if len(kinds) > 1:
        raise UserError(
            f"dataset directory {str(path)!r} mixes file types ({', '.join(sorted(kinds))})",
            "keep one kind of file per directory",
        )
    kind = kinds.pop()
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise UserError(f"dataset directory {str(path)!r} holds only empty files", "add files with examples")
    roles: dict[str, list[Path]] = {"train": [], "eval": [], "test": []}
    for f in files:
        roles[_split_role(f, path)].append(f)
    eval_files = roles["eval"] or roles["test"]
    train_files = roles["train"]
    if not train_files:  # only eval-looking names: use everything for training, hold out later
        train_files, eval_files = files, []
    train = _read_files(kind, train_files)
    evals = _read_files(kind, eval_files) if eval_files else None
    desc = f"directory: {path} ({len(train_files)} train file(s)" + (f", {len(eval_files)} eval file(s))" if eval_files else ")")
    return RawSplits(train, evals, desc)


def _read_files(kind: str, files: list[Path]) -> list[dict]:
    if kind == "text":
        rows = []
        for f in files:
            rows.extend({"text": t} for t in _text_examples(_read_text(f)))
        return rows
    if kind == "json":
        rows, lines_files = [], []
        for f in files:
            loaded = _read_json_document(f) if f.suffix.lower() == ".json" else None
            if loaded is None:
                lines_files.append(f)
            else:
                rows.extend(loaded)
        if lines_files:
            rows.extend(_read_with_datasets("json", lines_files))
        return rows
    return _read_with_datasets(kind, files)


def _read_text(path: Path) -> str:
    """The file as UTF-8 (undecodable bytes replaced), refused in one line when most of it is not text."""
    text = path.read_text(encoding="utf-8", errors="replace")
    bad = len(_UNREADABLE.findall(text))
    if text and bad > MAX_UNREADABLE_SHARE * len(text):
        raise UserError(f"dataset file {str(path)!r} is not text: {bad / len(text):.0%} of its {len(text):,} characters are not "
                        "UTF-8 or are control characters", "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or point "
                        "dataset.source at text files only")
    return text


def _read_json_document(path: Path) -> list[dict] | None:
    """A whole-document .json: SQuAD's nested layout, a list of records, or {key: [records]}.

    Returns None when the file is JSON Lines under a .json name, for the datasets loader.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if isinstance(doc, dict) and _is_squad(doc):
        return _flatten_squad(doc)
    if isinstance(doc, list) and all(isinstance(r, dict) for r in doc):
        return doc
    if isinstance(doc, dict):
        lists = [v for v in doc.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if len(lists) == 1:
            return lists[0]
        if all(not isinstance(v, (list, dict)) for v in doc.values()):
            return [doc]
    raise UserError(
        f"cannot find records in {str(path)!r}",
        "use JSON Lines, a JSON list of objects, or SQuAD's {\"data\": [...]} layout",
    )


def _is_squad(doc: dict) -> bool:
    data = doc.get("data")
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "paragraphs" in data[0]


def _flatten_squad(doc: dict) -> list[dict]:
    rows = []
    for article in doc["data"]:
        for para in article.get("paragraphs", []):
            for qa in para.get("qas", []):
                answers = [a for a in qa.get("answers", []) if isinstance(a, dict)]
                rows.append(
                    {
                        "title": article.get("title", ""),
                        "question": qa.get("question", ""),
                        "context": para.get("context", ""),
                        # the hub's squad layout; answer_start is kept so that misplaced answers can be found
                        "answers": {"text": [a.get("text", "") for a in answers], "answer_start": [a.get("answer_start") for a in answers]},
                    }
                )
    return rows


def _read_with_datasets(builder: str, files: list[Path]) -> list[dict]:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating train split" bars for a local file are noise
    try:
        loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        names = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
        raise UserError(f"could not read {names} as {builder}: {first}", "check the file's format") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    return loaded.to_list()
