"""A new user's inputs that used to fail late or not at all: a checkpoint of another model, a model directory with
nothing but its config, a dataset file that is not text. Each is one line naming the problem and the fix, exit 2,
and nothing written (test_cli_mistakes.py's helpers: the working directory stays empty)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_cli_mistakes import assert_error, one_error_line, run_cli, shardlab_subprocess


# ---- --resume from another model's checkpoint ------------------------------------------------------------


def checkpoint_of(run: Path, model: str) -> Path:
    """A finished run's complete checkpoint as store.save leaves it, its config naming `model` (the files the check
    reads; the tensors do not matter to it)."""
    from shardlab.checkpoint.store import CONFIG_FILE, TRAINER_STATE

    step = run / "checkpoints" / "step-0000002"
    step.mkdir(parents=True)
    (step / CONFIG_FILE).write_text(f"model: {model}\nseq_len: 32\n")
    (step / TRAINER_STATE).write_text('{"global_step": 2}')
    (run / "checkpoints" / "latest").write_text(step.name)
    return step


def test_resuming_another_models_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "llama-run"
    checkpoint_of(run, "tiny-llama")
    argv = ["train", "--resume", str(run), "--seq-len", "32", "--max-steps", "4", "--output-dir", "new"]
    line = assert_error(argv + ["--model", "tiny-gpt2"], tmp_path, capsys, monkeypatch, "holds another model",
                        "tiny-llama: llama", "tiny-gpt2: gpt2", "vocabulary 50257", "--model tiny-llama")
    assert "step-0000002" in line
    # the model it was written from passes the check (a dry run stops after it)
    code, _, err = run_cli(argv + ["--model", "tiny-llama", "--dry-run"], tmp_path, capsys, monkeypatch)
    assert code == 0 and "another model" not in err, err


@pytest.mark.slow  # a real tiny-llama run with a checkpoint
def test_resuming_a_real_tiny_llama_run_as_tiny_gpt2_writes_nothing(tmp_path, train_cli, capsys, monkeypatch):
    llama = train_cli(["--model", "tiny-llama", "--max-steps", "2", "--save-every", "2", "--seq-len", "32", "--micro-batch",
                       "2", "--no-export", "--set", "dataset.eval_samples=2"], tmp_path / "llama").check()
    assert_error(["train", "--resume", str(llama.out), "--model", "tiny-gpt2", "--seq-len", "32", "--micro-batch", "2",
                  "--output-dir", "gpt2"], tmp_path, capsys, monkeypatch, "holds another model", "--model tiny-llama")
    second = shardlab_subprocess(["train", "--resume", str(llama.out), "--model", "tiny-gpt2", "--seq-len", "32",
                                  "--micro-batch", "2", "--output-dir", str(tmp_path / "gpt2")], tmp_path)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    one_error_line(second.stderr, "holds another model")
    assert not (tmp_path / "gpt2").exists()  # so the same command is not then refused as "another run's files"


# ---- --model DIR with a config.json only ----------------------------------------------------------------


def test_a_model_directory_with_only_a_config_is_one_line(tmp_path, capsys, monkeypatch):
    from transformers import GPT2Config

    model = tmp_path / "gpt2-config-only"
    GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(model)
    base = ["train", "--model", str(model), "--max-steps", "1", "--seq-len", "32", "--output-dir", "run"]
    assert_error(base, tmp_path, capsys, monkeypatch, "has a config.json but no weights", "and no tokenizer", "save_pretrained")
    # synthetic data needs no tokenizer: the weights alone are missing
    line = assert_error(base + ["--dataset", "synthetic"], tmp_path, capsys, monkeypatch, "no weights")
    assert "tokenizer" not in line.split("(fix:")[0]
    # weights but no tokenizer: --tokenizer is the fix (transformers would build an empty one)
    (model / "model.safetensors").write_bytes(b"")
    assert_error(base, tmp_path, capsys, monkeypatch, "but no tokenizer", "--tokenizer")


# ---- a dataset file that is not text -----------------------------------------------------------------------


def test_random_bytes_as_a_text_dataset_are_one_line(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes(os.urandom(2_000_000))
    proc = shardlab_subprocess(["train", "--dataset", str(data), "--max-steps", "2", "--seq-len", "32",
                                "--output-dir", str(tmp_path / "run")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_error_line(proc.stderr, "corpus.txt", "is not text", "are not UTF-8", "iconv")
    share = int(line.split("is not text: ")[1].split("%")[0])
    assert 40 <= share <= 70  # about half: bytes >= 0x80 that do not decode, and ASCII control characters
    assert not (tmp_path / "run").exists()


def test_text_with_a_few_bytes_that_are_not_utf8_still_reads(tmp_path):
    from shardlab.config import DatasetConfig
    from shardlab.data.sources import classify, load_rows

    data = tmp_path / "latin1.txt"
    # Latin-1 prose read as UTF-8: its accented letters (15% here, more than in real prose) become U+FFFD
    data.write_bytes("Un café à Paris, déjà vu.\n\nLe garçon était là.\n".encode("latin-1"))
    ds = DatasetConfig(source=str(data))
    rows = load_rows(classify(ds), ds).train
    assert len(rows) == 2 and "\ufffd" in rows[0]["text"]


# ---- habits from other tools: what a user would expect to be told --------------------------------------------


def test_a_python_tag_in_the_yaml_is_named_as_executable_and_never_run(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "ran"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f'model: !!python/object/apply:os.system ["touch {marker}"]\n')
    assert_error(["train", "--config", str(cfg)], tmp_path, capsys, monkeypatch, "executable YAML tag !!python/object/apply:os.system",
                 "line 1:8", "not allowed", "remove the tag")
    assert not marker.exists()
    cfg.write_text("model: !Ref tiny-gpt2\n")  # CloudFormation's habit: refused as a tag, not as broken syntax
    line = assert_error(["train", "--config", str(cfg)], tmp_path, capsys, monkeypatch, "YAML tag !Ref")
    assert "syntax" not in line


def test_nodes_without_master_addr_say_they_meet_on_this_machine(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["train", "--nodes", "2", "--device", "cpu", "--dry-run"], tmp_path, capsys, monkeypatch)
    assert code == 0, err
    assert "# --nodes 2 without --master-addr: the nodes meet at 127.0.0.1, this machine" in out
    code, out, err = run_cli(["train", "--nodes", "2", "--master-addr", "10.0.0.1", "--device", "cpu", "--dry-run"],
                             tmp_path, capsys, monkeypatch)
    assert code == 0 and "without --master-addr" not in out, err


def test_a_run_that_keeps_no_weights_says_so_at_the_start_and_generate_does_not_suggest_export(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["train", "--no-export", "--device", "cpu", "--dry-run"], tmp_path, capsys, monkeypatch)
    assert code == 0 and "# --no-export without --save-every: the trained weights will not be kept" in out, err
    for kept in (["--save-every", "5"], []):  # a checkpoint, or the exported model
        code, out, err = run_cli(["train", *kept, "--device", "cpu", "--dry-run"], tmp_path, capsys, monkeypatch)
        assert code == 0 and "will not be kept" not in out, err
    run = tmp_path / "no-export-run"  # what such a run leaves: its record, no model/, no checkpoints/
    run.mkdir()
    for name in ("config.yaml", "summary.json", "metrics.jsonl"):
        (run / name).write_text("{}\n")
    line = assert_error(["generate", str(run), "--prompt", "Hello"], tmp_path, capsys, monkeypatch, "no exported model",
                        "no checkpoint", "weights were not kept", "without --no-export")
    assert "shardlab export" not in line


def test_bf16_on_a_cpu_without_native_bf16_says_it_is_slow(tmp_path, capsys, monkeypatch):
    from shardlab.training import cpu_bf16

    flags = tmp_path / "cpuinfo"
    flags.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_bf16.native_bf16(flags) is False
    flags.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_bf16.native_bf16(flags) is True
    argv = ["train", "--device", "cpu", "--precision", "bf16", "--dry-run"]
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda *a: False)
    code, out, err = run_cli(argv, tmp_path, capsys, monkeypatch)
    assert code == 0 and out.count("# precision bf16 on a CPU without native bf16 matrix multiplies") == 1, err
    assert "14-25x slower than in fp32" in out
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda *a: True)
    code, out, err = run_cli(argv, tmp_path, capsys, monkeypatch)
    assert code == 0 and "native bf16" not in out, err
