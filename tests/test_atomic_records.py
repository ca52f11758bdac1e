"""What a kill leaves is readable: records are replaced whole (measure/records.py), metrics.jsonl's torn last line is
skipped on resume, the plan record the supervisor reads after a kill is whole or absent, and a re-saved checkpoint
(checkpoints/best) is renamed aside before it is deleted, so that a complete copy exists at every moment. In-process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import store
from shardlab.measure import metrics
from shardlab.measure.records import read_json, read_jsonl, write_text_atomic

TORN = '{"step": 13, "loss": 0.4'  # what SIGKILL leaves mid-write: no closing brace, no newline


def test_a_write_that_dies_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    write_text_atomic(path, '{"old": 1}')

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for a kill between the write and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, '{"new": 2}')
    assert read_json(path) == {"old": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_torn_lines_and_records_read_as_what_is_whole(tmp_path):
    rows = tmp_path / "metrics.jsonl"
    rows.write_text('{"step": 1}\n{"step": 2}\n' + TORN)
    assert read_jsonl(rows) == [{"step": 1}, {"step": 2}] and read_jsonl(tmp_path / "none.jsonl") == []
    (tmp_path / "plan.json").write_text('{"cpu_gib": 3.')
    assert read_json(tmp_path / "plan.json") is None and read_json(tmp_path / "absent.json") is None


def test_resume_drops_a_torn_last_line_and_what_came_after_the_checkpoint(tmp_path):
    """metrics.jsonl of a run killed at step 13 mid-write, resumed from its step-10 checkpoint (the trainer's call)."""
    path = tmp_path / "metrics.jsonl"
    logged = [{"step": s, "loss": 1.0 / s} for s in range(1, 13)] + [{"step": 10, "eval_loss": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in logged) + TORN)
    metrics.drop_rows_after(path, 10)
    text = path.read_text()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [*range(1, 11), 10] and text.endswith("\n")
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]  # replaced whole, no temporary left


def test_the_plan_record_is_written_whole(tmp_path, monkeypatch):
    from shardlab.launch import supervise
    from shardlab.planning.run_plan import read_record, write_record

    plan = {"cpu_gib": 3.5, "gpu_peak_gib": None, "strategy": "dp"}
    monkeypatch.setenv(supervise.SUPERVISED_ENV, str(tmp_path / "supervised.json"))
    supervise.record_plan(plan)
    assert read_json(tmp_path / "supervised.json") == plan
    assert read_record(write_record(plan, tmp_path / "plan.json")) == plan
    (tmp_path / "plan.json").write_text('{"cpu_gib": 3.')  # a writer killed before this change left such a file
    assert read_record(tmp_path / "plan.json") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "supervised.json"]


# ---- checkpoints/best re-saved --------------------------------------------------------------------------


class _Env:
    rank, is_main = 0, True

    def barrier(self) -> None:
        pass


class _Strategy:
    """What store.save asks of a strategy: its env and a state written into the checkpoint directory."""

    env = _Env()

    def __init__(self, value: int):
        self.value = value

    def save_checkpoint(self, directory: Path) -> None:
        torch.save({"w": torch.full((2,), float(self.value))}, directory / "state.pt")


def _complete_copies(root: Path) -> list[int]:
    """The values of the complete checkpoints a reader finds for checkpoints/best (store.complete)."""
    found = store.complete(root / store.BEST)
    if found is None:
        return []
    return [int(torch.load(found / "state.pt", weights_only=True)["w"][0])]


def test_resaving_best_renames_the_old_copy_before_deleting_it(tmp_path, monkeypatch):
    """Every rename and delete of the second save is watched: before each, a reader finds a complete best (the old
    one or the new one); and a save killed at any of them leaves one for the next reader."""
    root = store.checkpoints_root(tmp_path)
    store.save(_Strategy(1), tmp_path, {"global_step": 5}, keep=2, name=store.BEST)
    assert _complete_copies(root) == [1]

    seen: list[tuple[str, list[int]]] = []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def watch(op, real):
        def call(*args, **kwargs):
            seen.append((f"{op} {Path(args[0]).name}", _complete_copies(root)))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(os, "replace", watch("replace", real_replace))
    monkeypatch.setattr(shutil, "rmtree", watch("rmtree", real_rmtree))
    store.save(_Strategy(2), tmp_path, {"global_step": 9}, keep=2, name=store.BEST)
    monkeypatch.undo()
    moves = [op for op, _ in seen if op.startswith(("replace best", "rmtree best"))]
    # the old copy renamed aside, the new one renamed into place, then the old one deleted
    assert moves[-3:] == ["replace best", "replace best.tmp", "rmtree best.old"], moves
    assert all(copies in ([1], [2]) for _, copies in seen), seen
    assert _complete_copies(root) == [2] and sorted(p.name for p in root.iterdir()) == [store.BEST]

    # killed at each rename or delete of a third save: the next reader (and the next save) still finds a best
    for k in range(len(seen)):
        calls = [0]

        def dies(real, calls=calls, k=k):  # this iteration's counter and limit, bound
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] > k:
                    raise KeyboardInterrupt
                return real(*args, **kwargs)
            return call

        monkeypatch.setattr(os, "replace", dies(real_replace))
        monkeypatch.setattr(shutil, "rmtree", dies(real_rmtree))
        with pytest.raises(KeyboardInterrupt):
            store.save(_Strategy(3), tmp_path, {"global_step": 11}, keep=2, name=store.BEST)
        monkeypatch.undo()
        assert _complete_copies(root) in ([2], [3]), (k, sorted(p.name for p in root.iterdir()))
        store.save(_Strategy(2), tmp_path, {"global_step": 9}, keep=2, name=store.BEST)  # the next save recovers
        assert _complete_copies(root) == [2] and sorted(p.name for p in root.iterdir()) == [store.BEST], k


def test_a_rotated_checkpoints_old_copy_is_never_the_newest(tmp_path):
    root = store.checkpoints_root(tmp_path)
    store.save(_Strategy(1), tmp_path, {"global_step": 1}, keep=2)
    shutil.copytree(root / "step-0000001", root / "step-0000001.old")  # a kill mid re-save of step 1 left this
    assert store.find_resume_dir("auto", tmp_path) == root / "step-0000001"
    shutil.rmtree(root / "step-0000001")  # ...and the kill came between the two renames
    assert store.find_resume_dir("auto", tmp_path) == root / "step-0000001.old"
