"""benchmarks/peers.py on CPU: the HF Trainer + DeepSpeed peer path end to end with tiny-gpt2 (the GPU run compares it
with shardlab and the bare loop), the WikiText-style data it trains on, and the ratio table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers.py"


def load_peers():
    spec = importlib.util.spec_from_file_location("peers", PEERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wikitext_style_lines_have_wikitexts_layout():
    lines = load_peers().wikitext_style_lines()
    assert len(lines) > 1000
    assert lines[0].startswith(" = ") and lines[0].endswith(" = ")  # headings as WikiText-2-raw writes them
    assert lines.count("") >= len(lines) // 3  # blank rows between paragraphs, padded to full length by the tutorials
    assert all("\n" not in line for line in lines)


def test_ratios_pair_shardlab_with_each_peer():
    peers = load_peers()
    rows = [{"peer": "shardlab zero2", "useful_tokens_per_s": 45_000.0}, {"peer": "hf-padded", "useful_tokens_per_s": 9_000.0},
            {"peer": "hf-packed", "useful_tokens_per_s": 40_000.0}, {"peer": "shardlab dp-noclip", "useful_tokens_per_s": 57_000.0},
            {"peer": "bare-eager", "useful_tokens_per_s": 58_000.0}]
    got = {(r["shardlab"], r["peer"]): r for r in peers.ratios(rows, "zero2")}
    assert got[("shardlab zero2", "hf-padded")]["ratio"] == pytest.approx(5.0) and got[("shardlab zero2", "hf-padded")]["met"] is True
    assert got[("shardlab zero2", "hf-packed")]["target"] is None
    assert got[("shardlab dp-noclip", "bare-eager")]["met"] is False


@pytest.mark.slow  # a transformers.Trainer + DeepSpeed training run
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers.Trainer needs accelerate (pip install accelerate)")
def test_hf_trainer_deepspeed_peer_runs_on_cpu(tmp_path):
    out = tmp_path / "peers"
    proc = subprocess.run([sys.executable, str(PEERS), "--device", "cpu", "--model", "tiny-gpt2", "--seq", "64", "--micro", "2",
                           "--steps", "8", "--precision", "fp32", "--peers", "hf-padded", "--no-shardlab", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads((out / "peers.json").read_text())["rows"]
    assert row["peer"] == "hf-padded" and row["engine"] == "transformers.Trainer + DeepSpeed ZeRO-2"
    assert row["steps"] == 8 and row["timed_steps"] == 5  # 3 warm-up steps excluded, as shardlab does
    assert row["tokens_per_s"] == pytest.approx(2 * 64 / row["step_time_median_s"])
    assert 0 < row["useful_tokens_per_s"] < row["tokens_per_s"]  # padded lines: most tokens are padding
    assert 0 < row["non_pad_fraction"] < 0.5
    assert row["train_rows"] == sum(1 for _ in (out / "wikitext_style.txt").open())  # one sample per line, blank lines too
    assert "| hf-padded | transformers.Trainer + DeepSpeed ZeRO-2 |" in (out / "peers.md").read_text()


@pytest.mark.slow  # a transformers.Trainer + peft run
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="transformers.Trainer needs accelerate (pip install accelerate)")
def test_the_lora_peer_trains_the_adapters_shardlab_trains(tmp_path):
    """benchmarks/peer_lora.py (HF Trainer + peft) on tiny-llama: the same adapters as `--peft lora` (r 8 on every
    linear layer of the blocks: shardlab's count), its steps timed after the warm-up, and the loss it reports finite."""
    from shardlab.config import load_config
    from shardlab.training import adapters
    from shardlab.training.models import build_model

    out = tmp_path / "peer-lora.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer_lora.py"), "--model", "tiny-llama", "--device", "cpu",
                           "--precision", "fp32", "--micro", "2", "--seq", "32", "--steps", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    row = json.loads(out.read_text())
    cfg = load_config(None, {"model": "tiny-llama", "device": "cpu", "peft.method": "lora"})
    ours = adapters.apply(build_model(cfg), cfg)
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert (row["trainable_params"], row["total_params"]) == (trainable, sum(p.numel() for p in ours.parameters()))
    assert row["steps"] == 5 and row["timed_steps"] == 2 and row["tokens_per_s"] == pytest.approx(2 * 32 / row["step_time_median_s"])
    assert row["train_loss"] == row["train_loss"] and row["train_loss"] > 0  # finite
