"""compat/: every patch of a dependency's internals is declared once with the versions it was tested on; outside them,
or switched off (SHARDLAB_PATCHES), it is off with one line and the dependency's own path runs; summary.json says
which applied; what a run patched process-wide is undone when it ends. In-process, no training subprocess."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import torch

from shardlab import compat
from shardlab.compat import PATCHES
from shardlab.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "shardlab"


@pytest.fixture(autouse=True)
def fresh_record():
    compat.start_run()
    yield
    compat.start_run()


def _gate_off(monkeypatch, name: str) -> None:
    """Patch ``name``'s version gate forced off: its tested versions exclude every installed release."""
    monkeypatch.setitem(PATCHES, name, dataclasses.replace(PATCHES[name], tested=tuple((d, "<0.0.1") for d, _ in PATCHES[name].tested)))


# ---- the declarations ----------------------------------------------------------------------------


def test_every_patch_has_its_module_and_applies_here():
    for p in PATCHES.values():
        assert importlib.util.find_spec(f"shardlab.compat.{p.module}") is not None, p
        assert p.tested and p.scope in ("object", "process", "call", "files") and p.off, p
        assert compat.why_off(p.name) is None, p  # this image is one of those the patches were tested on


def test_pyproject_admits_the_tested_versions_and_no_others():
    deps = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for dist, spec in (compat.TORCH, compat.TRANSFORMERS, compat.DEEPSPEED, compat.DATASETS):
        assert deps[dist].replace(" ", "") == dist + spec.replace(" ", ""), (deps[dist], spec)


@pytest.mark.parametrize("version, spec, inside", [
    ("2.11.0+cu130", compat.TORCH[1], True), ("2.13.0+cpu", compat.TORCH[1], True), ("2.13.1", compat.TORCH[1], True),
    ("2.14.0.dev20260101", compat.TORCH[1], False), ("2.10.0", compat.TORCH[1], False),
    ("0.19.8", compat.DEEPSPEED[1], True), ("0.19.9", compat.DEEPSPEED[1], False), ("not-a-version", ">=1", False),
])
def test_a_version_is_in_range_by_its_release_numbers(version, spec, inside):
    assert compat.in_range(version, spec) is inside


def test_no_patch_outside_compat():
    """A class or module of another package assigned to outside compat/ (``stage3.reduce_scatter_coalesced = ...``,
    ``setattr(threading.Thread, ...)``), or one of the private hooks the patches use set on an object: back in compat."""
    hooks = {"forward", "_initialize_weights", "_partition_all_parameters", "_get_norm_groups", "grad_scale", "step",
             "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "hf_quantizer",
             "copy_args_to_cpu_if_needed", "reduce_scatter_coalesced", "reset_step", "HF_HUB_OFFLINE", "start",
             "_execute_child", "spawnv_passfds", "posix_spawn", "posix_spawnp"}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.parent.name == "compat":
            continue
        tree = ast.parse(path.read_text())
        foreign = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and not (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("shardlab")))
                   for a in n.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr=getattr(node.args[1], "value", "?"))]
            for t in targets:
                if not isinstance(t, ast.Attribute):
                    continue
                on_import = isinstance(t.value, ast.Name) and t.value.id in foreign
                if on_import or t.attr in hooks:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: .{t.attr}")
    assert not found, found


# ---- the switch ----------------------------------------------------------------------------------


def test_the_switch_turns_one_off_all_off_and_one_on_outside_its_versions(monkeypatch):
    monkeypatch.setenv(compat.SWITCH_ENV, "-bloom_sdpa")
    assert "SHARDLAB_PATCHES" in compat.why_off("bloom_sdpa") and compat.why_off("fused_clip") is None
    monkeypatch.setenv(compat.SWITCH_ENV, "-all,+fused_clip")
    assert compat.why_off("bloom_sdpa") and compat.why_off("fused_clip") is None
    _gate_off(monkeypatch, "fused_clip")
    assert compat.why_off("fused_clip") is None  # +NAME: on outside its tested versions
    monkeypatch.setenv(compat.SWITCH_ENV, "")
    assert "outside the versions it was tested on" in compat.why_off("fused_clip")
    assert "SHARDLAB_PATCHES=+fused_clip" in compat.why_off("fused_clip")


@pytest.mark.parametrize("value", ["-no_such_patch", "bloom_sdpa", "+all"])
def test_a_switch_naming_no_patch_is_one_line_with_the_names(monkeypatch, value):
    monkeypatch.setenv(compat.SWITCH_ENV, value)
    with pytest.raises(UserError) as err:
        compat.check_switch()
    assert "\n" not in str(err.value) and "bloom_sdpa" in err.value.hint
    monkeypatch.setenv(compat.SWITCH_ENV, "-bloom_sdpa, +fused_clip,-all")
    compat.check_switch()


def test_off_is_said_once_recorded_and_undone_when_the_run_ends(monkeypatch, capsys):
    _gate_off(monkeypatch, "hub_offline")
    assert not compat.enabled("hub_offline") and not compat.enabled("hub_offline")
    lines = [line for line in capsys.readouterr().out.splitlines() if "hub_offline" in line]
    assert len(lines) == 1 and "patch hub_offline off: datasets" in lines[0] and PATCHES["hub_offline"].off in lines[0]
    undone = []
    compat.applied("fused_clip")
    compat.applied("identity_reduce_scatter", lambda: undone.append("identity_reduce_scatter"))
    compat.applied("fused_clip")
    assert compat.summary() == {"patches": ["fused_clip", "identity_reduce_scatter"],
                                "patches_off": {"hub_offline": compat.why_off("hub_offline")}}
    compat.restore_all()
    assert undone == ["identity_reduce_scatter"]
    compat.restore_all()
    assert undone == ["identity_reduce_scatter"]  # once


def test_a_process_wide_patch_is_undone_when_the_run_ends():
    from deepspeed.runtime.zero import stage3

    from shardlab.compat import zero3_one_rank

    own = stage3.reduce_scatter_coalesced
    zero3_one_rank.identity_reduce_scatter()
    assert stage3.reduce_scatter_coalesced is not own and compat.summary()["patches"] == ["identity_reduce_scatter"]
    compat.restore_all()
    assert stage3.reduce_scatter_coalesced is own


# ---- gate forced off: the dependency's own path, the same losses ---------------------------------


def _bloom_losses(attn: str) -> tuple[list[float], int]:
    """5 AdamW steps of tiny-bloom, fp32 on the CPU; the losses and how many attention modules were patched."""
    from transformers.models.bloom.modeling_bloom import BloomAttention

    from shardlab.config import RunConfig
    from shardlab.training.models import build_model

    model = build_model(RunConfig(model="tiny-bloom", device="cpu", attn_implementation=attn)).train()
    patched = sum(1 for m in model.modules() if isinstance(m, BloomAttention) and "forward" in vars(m))
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, 1000, (2, 32), generator=g)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, patched


def test_bloom_sdpa_with_its_version_gate_off_runs_transformers_eager_attention_with_the_same_losses(monkeypatch, capsys):
    patched, n = _bloom_losses("auto")
    assert n == 2 and compat.summary()["patches"] == ["bloom_sdpa"]
    eager, _ = _bloom_losses("eager")
    compat.start_run()
    _gate_off(monkeypatch, "bloom_sdpa")
    gated, n = _bloom_losses("auto")
    assert n == 0  # no BloomAttention.forward replaced: transformers' own
    assert gated == eager  # the engine's own path, bit for bit
    for step, (want, got) in enumerate(zip(patched, gated)):
        assert got == pytest.approx(want, rel=1e-3), (step, patched, gated)  # what the patch computes, the same losses
    assert compat.summary() == {"patches": [], "patches_off": {"bloom_sdpa": compat.why_off("bloom_sdpa")}}
    said = [line for line in capsys.readouterr().out.splitlines() if "bloom_sdpa" in line]
    assert len(said) == 1 and "transformers 5." in said[0] and "eager BLOOM attention" in said[0]
