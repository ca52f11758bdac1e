"""The report's "full fine-tuning or an adapter?" table and guide lines (report/adapters.py), from the summaries of
one H200's LoRA and QLoRA runs (benchmarks/results/2026-11-28-h200-adapters/call3) beside a full fine-tuning cell."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from shardlab.report import build_tables
from shardlab.report.adapters import adapter_guide, adapter_plot, adapter_tables
from shardlab.report.guide import guide
from shardlab.report.load import Cell, Run

CALL = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-28-h200-adapters/call3"


def _cell(label: str, summary: dict, **kw) -> Cell:
    run = Run(CALL, summary, {"model": summary["model"], "strategy": summary["strategy"]})
    return Cell(label, {"model": summary["model"], **kw.pop("config", {})}, runs=[run], parts=["adapters/adapters"], **kw)


def _summaries() -> dict[str, dict]:
    return {name: json.loads((CALL / f"{name}.summary.json").read_text()) for name in ("lora-1", "lora-2", "qlora")}


def _full(lora: dict, tok_s: float, peak: float) -> dict:
    s = copy.deepcopy(lora)
    s.update(adapter=None, strategy="fsdp", useful_tokens_per_s=tok_s, tokens_per_s=tok_s, gpu_mem_peak_gib=peak,
             final_train_loss=10.9)
    return s


def test_adapters_table_puts_each_method_beside_full_fine_tuning():
    s = _summaries()
    cells = [_cell("fsdp", _full(s["lora-1"], 9000.0, 120.0)), _cell("lora", s["lora-1"]), _cell("qlora", s["qlora"])]
    [table] = adapter_tables(cells)
    rows = {r["label"]: r for r in table.rows}
    assert {r["method"] for r in table.rows} == {"full", "lora r 8", "qlora r 8"}
    assert rows["lora"]["trainable"] == "19,988,480 / 6,758,404,096"
    assert rows["fsdp"]["trainable"].startswith("all ")
    assert rows["lora"]["predicted_gib"] == s["lora-1"]["plan"]["gpu_peak_gib"]
    lines = adapter_guide(table)
    # lora-1 ran at 12,247 tok/s in 63.41 GiB: 1.36x the full run's 9,000 in 53% of its 120 GiB
    assert "fastest full fine-tuning that ran is fsdp (full)" in lines[0]
    assert "1.36x its speed in 53% of its memory" in lines[0]
    assert any(t.key == "adapters" for t in build_tables(cells))
    assert any(line.startswith("Full fine-tuning or an adapter?") for line in guide(build_tables(cells), cells))


def test_when_full_fine_tuning_did_not_run_the_guide_says_only_adapters_ran():
    s = _summaries()
    failed = Cell("zero3", {"model": "llama-2-7b", "strategy": "zero3"}, runs=[], parts=["adapters/adapters"],
                  failures=[{"status": "failed", "reason": "CUDA out of memory"}])
    [table] = adapter_tables([failed, _cell("lora", s["lora-1"]), _cell("qlora", s["qlora"])])
    line = adapter_guide(table)[0]
    assert "only adapters ran (full fine-tuning: zero3 did not)" in line
    assert "fastest lora (lora r 8)" in line


def test_a_suite_without_adapters_has_no_adapter_table():
    s = _summaries()
    assert adapter_tables([_cell("fsdp", _full(s["lora-1"], 9000.0, 120.0))]) == []


def test_the_report_draws_speed_against_memory_for_the_adapter_runs(tmp_path):
    s = _summaries()
    cells = [_cell("fsdp", _full(s["lora-1"], 9000.0, 120.0)), _cell("lora", s["lora-1"]), _cell("qlora", s["qlora"])]
    plot = adapter_plot(build_tables(cells))
    assert plot is not None and plot.png.startswith(b"\x89PNG")
    assert adapter_plot(build_tables([_cell("fsdp", _full(s["lora-1"], 9000.0, 120.0))])) is None
