"""checkpoint/trust.py: a checkpoint shardlab wrote for this user (its seal verifies) loads as it is; any other is
screened without running anything in it, and one holding a pickle that would run code is refused in one line, before
any worker starts, unless --trust-checkpoint. In-process: the checkpoints are made here, DCP's and DeepSpeed's
formats as their loaders read them."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import store, trust
from shardlab.cli import main
from shardlab.errors import UserError


class RunsCode:
    """Unpickling this creates a directory: what a checkpoint from elsewhere could do in a loader that trusts it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture
def own_key(tmp_path, monkeypatch):
    """This user's key in a cache directory of the test's own."""
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / trust.KEY_FILE


def dcp_checkpoint(directory: Path, extra=None) -> Path:
    """A complete dp/fsdp-style checkpoint: DCP (tensors and the optimizer's non-tensor param_groups) and a trainer
    state, as store.save leaves it."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(4.0)}, "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]}}
    if extra is not None:
        state["optimizer"]["param_groups"][0]["hook"] = extra
    dcp.save(state, checkpoint_id=str(directory / "torch_dcp"), no_dist=True)
    (directory / store.TRAINER_STATE).write_text(json.dumps({"global_step": 2}))
    return directory


def test_a_checkpoint_sealed_here_loads_as_it_is_and_not_once_a_pickle_changed(tmp_path, own_key):
    ckpt = dcp_checkpoint(tmp_path / "ckpt")
    assert trust.seal(ckpt) and own_key.stat().st_mode & 0o777 == 0o600
    assert trust.sealed_here(ckpt) and trust.check_checkpoint(ckpt, False, "--resume x") == "sealed"
    metadata = ckpt / "torch_dcp" / ".metadata"
    metadata.write_bytes(metadata.read_bytes() + b".")  # pickle.load ignores what follows the pickle
    assert not trust.sealed_here(ckpt)


def test_a_node_seals_the_part_of_a_checkpoint_it_holds(tmp_path, own_key):
    """Nodes without a shared disk each keep their own ranks' DCP files under one metadata: node 0 seals (and later
    screens) what it holds, a file that lives on another node is none to unpickle here. Two nodes on one machine with
    two output directories failed their first save when the seal opened rank 1's file."""
    ckpt = dcp_checkpoint(tmp_path / "ckpt")
    full = trust.pickle_digest(ckpt)
    data = sorted((ckpt / "torch_dcp").glob("*.distcp"))
    assert data
    for f in data:
        f.unlink()  # as on node 0 when the metadata indexes another node's file
    assert trust.seal(ckpt) and trust.sealed_here(ckpt) and trust.pickle_digest(ckpt) != full


def test_another_users_clean_checkpoint_is_screened_and_loads(tmp_path, own_key, monkeypatch):
    ckpt = dcp_checkpoint(tmp_path / "ckpt")
    torch.save({"scheduler": {"last_epoch": 2}}, ckpt / "torch_extra.pt")
    trust.seal(ckpt)
    monkeypatch.setenv("SHARDLAB_CACHE", str(tmp_path / "another-users-cache"))  # another key
    said = []
    assert not trust.sealed_here(ckpt)
    assert trust.check_checkpoint(ckpt, False, "--resume x", said.append) == "screened"
    assert len(said) == 1 and "screened" in said[0]


def _refused(ckpt: Path, marker: Path, *words: str) -> None:
    with pytest.raises(UserError) as err:
        trust.check_checkpoint(ckpt, False, "--resume x")
    line = str(err.value)
    assert "\n" not in line and "--trust-checkpoint" in line and "not written by shardlab" in line, line
    for word in words:
        assert word in line, line
    assert not marker.exists()


def test_dcp_metadata_that_would_run_code_is_refused_without_running_it(tmp_path, own_key):
    ckpt = dcp_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "code-ran"
    (ckpt / "torch_dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))  # DCP's reader: pickle.load
    _refused(ckpt, marker, "torch_dcp/.metadata", "mkdir")


def test_a_dcp_item_that_would_run_code_is_refused_without_running_it(tmp_path, own_key):
    """The optimizer's non-tensor items go through torch.load(weights_only=False) in DCP's default planner: the real
    loader runs this one (shown on a copy), the screen does not."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "code-ran"
    ckpt = dcp_checkpoint(tmp_path / "ckpt", extra=RunsCode(marker))
    _refused(ckpt, marker, "torch_dcp/.metadata", "mkdir", "item __0_0.distcp@")
    dcp.load({"optimizer": {"param_groups": [{"hook": None}]}}, checkpoint_id=str(ckpt / "torch_dcp"), no_dist=True)
    assert marker.exists()  # what the screen kept from happening


def test_a_deepspeed_file_that_would_run_code_is_refused_without_running_it(tmp_path, own_key):
    ckpt = tmp_path / "ckpt"
    (ckpt / "deepspeed").mkdir(parents=True)
    (ckpt / store.TRAINER_STATE).write_text(json.dumps({"global_step": 2}))
    marker = tmp_path / "code-ran"
    torch.save({"module": {"w": torch.ones(2)}, "ds_config": RunsCode(marker)}, ckpt / "deepspeed" / "mp_rank_00_model_states.pt")
    _refused(ckpt, marker, "deepspeed/mp_rank_00_model_states.pt", "mkdir")


def test_a_seal_copied_onto_a_foreign_checkpoint_proves_nothing(tmp_path, own_key):
    own = dcp_checkpoint(tmp_path / "own")
    trust.seal(own)
    marker = tmp_path / "code-ran"
    foreign = dcp_checkpoint(tmp_path / "foreign", extra=RunsCode(marker))
    (foreign / trust.SEAL_FILE).write_text((own / trust.SEAL_FILE).read_text())
    _refused(foreign, marker, "mkdir")


def test_trust_checkpoint_skips_the_screen(tmp_path, own_key):
    marker = tmp_path / "code-ran"
    ckpt = dcp_checkpoint(tmp_path / "ckpt", extra=RunsCode(marker))
    assert trust.check_checkpoint(ckpt, True, "--resume x") == "trusted" and not marker.exists()


def test_resume_from_a_foreign_checkpoint_is_refused_before_anything_starts(tmp_path, own_key, capsys, monkeypatch):
    """`shardlab train --resume DIR`: exit 2, one line naming the file and the fix; the pickle never ran and the run
    wrote nothing (no output directory, no worker)."""
    marker = tmp_path / "code-ran"
    ckpt = dcp_checkpoint(tmp_path / "downloaded" / "checkpoints" / "step-0000002", extra=RunsCode(marker))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-gpt2", "--max-steps", "4", "--seq-len", "16", "--resume", str(ckpt.parent.parent),
                 "--output-dir", str(out)])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --resume "), captured.err
    assert "torch_dcp/.metadata holds a pickle that calls" in lines[0] and "--trust-checkpoint" in lines[0]
    assert not marker.exists() and not out.exists() and "launching" not in captured.out
