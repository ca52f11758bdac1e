"""Peers' DeepSpeed JSON files as they are (tests/data/README.md: where each comes from): what DeepSpeed 0.19.8 cannot
take is one line before any worker starts, naming every refused key; the rest trains tiny-gpt2 on the CPU unchanged.

The refusals and the resolved configs are checked in-process through `shardlab.cli.main` (test_cli_mistakes.py's
helpers: an empty working directory stays empty); the trainings are real `shardlab train` runs (slow tier).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_cli_mistakes import assert_error, run_cli

DATA = Path(__file__).parent / "data"
AXOLOTL_ZERO1_COMPILE = DATA / "axolotl_zero1_torch_compile.json"
AXOLOTL_ZERO2_COMPILE = DATA / "axolotl_zero2_torch_compile.json"
AXOLOTL_ZERO3_PARAMS = DATA / "axolotl_zero3_bf16_cpuoffload_params.json"
TRANSFORMERS_ZERO3 = DATA / "transformers_ds_config_zero3.json"
TRANSFORMERS_ZERO3_FIXED = DATA / "transformers_ds_config_zero3_fixed_values.json"
DEEPSPEED_CHAT = DATA / "deepspeed_chat_step1_zero2.json"


def dry_run(json_file: Path, tmp_path, capsys, monkeypatch, *extra: str) -> tuple[str, dict, dict]:
    """`shardlab train --deepspeed-config JSON --dry-run`: (its notes, the resolved config, the DeepSpeed JSON)."""
    code, out, err = run_cli(["train", "--deepspeed-config", str(json_file), "--device", "cpu", *extra, "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0, err
    resolved, ds = out.split("# DeepSpeed config\n")
    return resolved, yaml.safe_load(resolved), json.loads(ds)


@pytest.mark.parametrize("peer_json, strategy", [(AXOLOTL_ZERO1_COMPILE, "zero1"), (AXOLOTL_ZERO2_COMPILE, "zero2_offload")])
def test_an_old_compile_section_becomes_compile(peer_json, strategy, tmp_path, capsys, monkeypatch):
    """DeepSpeed <= 0.15's `compile: {disable: false, backend: inductor}` (torch.compile of the engine) is refused by
    DeepSpeed 0.19.8's DeepCompile section: shardlab runs --compile (DeepSpeed's engine.compile) instead and says so."""
    notes, resolved, ds = dry_run(peer_json, tmp_path, capsys, monkeypatch)
    assert f"# --compile, from {peer_json.name}'s compile section (disable: false, backend: \"inductor\"" in notes
    assert resolved["compile"] is True and resolved["strategy"] == strategy
    assert "compile" not in ds
    # an explicit --no-compile wins, and the section is still not passed on
    notes, resolved, ds = dry_run(peer_json, tmp_path, capsys, monkeypatch, "--no-compile")
    assert resolved["compile"] is False and "compile" not in ds and "--no-compile given" in notes


def test_every_key_deepspeed_refuses_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "ds_bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0, "overlap_comms": True},
                               "compile": {"deepcompile": "maybe"}, "bf16": {"enabled": "auto", "loss_scale": 0}}))
    run = ["train", "--device", "cpu", "--max-steps", "1", "--output-dir", "run", "--deepspeed-config", str(bad)]
    line = assert_error(run, tmp_path, capsys, monkeypatch, "DeepSpeed 0.19.8 refuses 4 setting(s) of ds_bad.json",
                        "zero_optimization.reduce_bucket_size = 0: input should be greater than 0",
                        "zero_optimization.overlap_comms: not a key DeepSpeed knows", "compile.deepcompile = 'maybe'",
                        "bf16.loss_scale: not a key DeepSpeed knows")
    assert "Traceback" not in line
    # two ranks: the same line from the launching process, before any worker exists
    assert_error(run + ["--gpus", "2"], tmp_path, capsys, monkeypatch, "refuses 4 setting(s)")
    # an old compile section with another backend: shardlab cannot honour it
    other = tmp_path / "ds_eager.json"
    other.write_text(json.dumps({"zero_optimization": {"stage": 1}, "compile": {"disable": False, "backend": "eager"}}))
    assert_error(["train", "--device", "cpu", "--deepspeed-config", str(other)], tmp_path, capsys, monkeypatch,
                 "compile.backend 'eager'", "inductor")


def test_older_transformers_template_with_zero_buckets_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """transformers' test ds_config_zero3.json before "auto": reduce_bucket_size 0, which DeepSpeed 0.19.8 refuses
    (greater than 0); its 0 prefetch bucket and persistence threshold are allowed and not named."""
    line = assert_error(["train", "--device", "cpu", "--max-steps", "1", "--deepspeed-config", str(TRANSFORMERS_ZERO3_FIXED)],
                        tmp_path, capsys, monkeypatch, "refuses 1 setting(s) of transformers_ds_config_zero3_fixed_values.json",
                        "zero_optimization.reduce_bucket_size = 0", '"auto"')
    assert "prefetch" not in line and "persistence" not in line


def test_a_deprecated_zero_name_replaces_shardlabs_own(tmp_path, capsys, monkeypatch):
    """transformers' ds_config_zero3.json spells stage3_gather_16bit_weights_on_model_save by its deprecated name; the
    generated section must then not carry the new name too (DeepSpeed asserts "Cannot provide deprecated parameter ...
    together"). Axolotl's file uses the field names of the stage3_ aliases: the same rule."""
    _, _, ds = dry_run(TRANSFORMERS_ZERO3, tmp_path, capsys, monkeypatch)
    zero = ds["zero_optimization"]
    assert zero["stage3_gather_fp16_weights_on_model_save"] is True and "stage3_gather_16bit_weights_on_model_save" not in zero
    _, _, ds = dry_run(AXOLOTL_ZERO3_PARAMS, tmp_path, capsys, monkeypatch)
    zero = ds["zero_optimization"]
    assert zero["max_live_parameters"] == 0 and "stage3_max_live_parameters" not in zero
    assert zero["gather_16bit_weights_on_model_save"] is True and "stage3_gather_16bit_weights_on_model_save" not in zero


def test_parameter_only_offload_is_said_not_silently_widened(tmp_path, capsys, monkeypatch):
    notes, resolved, ds = dry_run(AXOLOTL_ZERO3_PARAMS, tmp_path, capsys, monkeypatch)
    assert resolved["strategy"] == "zero3_offload"
    assert ("# axolotl_zero3_bf16_cpuoffload_params.json offloads the parameters only; strategy zero3_offload adds "
            "offload_optimizer {device: cpu} (no shardlab strategy offloads the parameters alone)") in notes
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # what the note says is what runs


def test_the_jsons_batch_sizes_are_taken_when_no_flag_sets_them(tmp_path, capsys, monkeypatch):
    """DeepSpeed-Chat's micro batch 16 against shardlab's default 8: taken, as the stage and precision are; a flag
    that contradicts it is still refused, and sizes that do not fit the ranks are named as the JSON's."""
    notes, resolved, ds = dry_run(DEEPSPEED_CHAT, tmp_path, capsys, monkeypatch)
    assert "# batch sizes from deepspeed_chat_step1_zero2.json (train_micro_batch_size_per_gpu 16, train_batch_size 16)" in notes
    assert (resolved["micro_batch"], resolved["grad_accum"], resolved["global_batch"]) == (16, 1, 16)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (16, 16)
    run = ["train", "--device", "cpu", "--max-steps", "1", "--deepspeed-config", str(DEEPSPEED_CHAT)]
    assert_error(run + ["--micro-batch", "8"], tmp_path, capsys, monkeypatch, "train_micro_batch_size_per_gpu=16",
                 "resolves it to 8")
    assert_error(run + ["--gpus", "2"], tmp_path, capsys, monkeypatch, "deepspeed_chat_step1_zero2.json sets "
                 "train_micro_batch_size_per_gpu 16, train_batch_size 16", "not divisible by micro_batch 16")


@pytest.mark.slow
@pytest.mark.parametrize("peer_json, strategy, extra", [
    (AXOLOTL_ZERO1_COMPILE, "zero1", ["--micro-batch", "2"]),
    (AXOLOTL_ZERO2_COMPILE, "zero2_offload", ["--micro-batch", "2"]),
    (AXOLOTL_ZERO3_PARAMS, "zero3_offload", ["--micro-batch", "2"]),
    (TRANSFORMERS_ZERO3, "zero3_offload", ["--micro-batch", "2"]),
    (DEEPSPEED_CHAT, "zero2", []),  # its own micro batch 16
], ids=["axolotl-zero1-compile", "axolotl-zero2-compile", "axolotl-zero3-params", "transformers-zero3", "deepspeed-chat"])  # fmt: skip
def test_peer_json_trains_unchanged(peer_json, strategy, extra, tmp_path, train_cli, monkeypatch):
    from shardlab.training import compiling

    # aot_eager: what is tested is that DeepSpeed's engine is compiled and trains; inductor's C++ compile is minutes on
    # 2 cores (test_compile_stats compiles with inductor)
    monkeypatch.setenv(compiling.BACKEND_ENV, "aot_eager")
    run = train_cli(["--deepspeed-config", str(peer_json), "--max-steps", "10", "--seq-len", "32", *extra, "--lr", "2e-3",
                     "--log-every", "1", "--no-export", "--set", "dataset.eval_samples=1"], tmp_path / "run").check()
    assert run.config["strategy"] == strategy and run.summary["compile"] == ("compile" in json.loads(peer_json.read_text()))
    losses = run.losses
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
