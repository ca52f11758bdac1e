"""Full fine-tuning or an adapter? (`shardlab bench --suite adapters`): one model's full fine-tuning beside LoRA and
QLoRA at one micro-batch, sequence, precision and step count, as a table and a few guide lines that quote it."""

from __future__ import annotations

from typing import Any

from .load import Cell
from .memory import planned_row
from . import plots
from .plots import COLORS, Plot
from .render import fmt
from .tables import Column, Table, group_by, med, where_ran

PART = "adapters"

COLUMNS = [
    Column("label", "Run", "text"), Column("method", "Method", "text"), Column("strategy", "Strategy", "text"),
    Column("trainable", "Trained / total parameters", "text"), Column("useful_tokens_per_s", "Useful tok/s"),
    Column("mfu_pct", "MFU %", "pct"), Column("gpu_peak_gib", "Peak GPU mem (GiB)", "gib"),
    Column("predicted_gib", "Predicted GPU (GiB)", "gib"), Column("cpu_rss_peak_gb", "Peak host RSS (GB)", "gb"),
    Column("predicted_cpu_gib", "Predicted host (GiB)", "gib"), Column("final_loss", "Loss after N steps", "loss"),
    Column("status", "Status", "text"),
]


def _method(c: Cell) -> str:
    peft = c.first("adapter") or {}
    if peft.get("method"):
        return f"{peft['method']} r {peft.get('r')}"
    return (c.setting("peft.method") or "full") if not c.ok else "full"


def _trainable(c: Cell) -> str:
    peft = c.first("adapter") or {}
    if peft.get("trainable_params"):
        return f"{peft['trainable_params']:,} / {peft['total_params']:,}"
    n = c.first("n_params")
    return f"all {n:,}" if n else ""


def adapter_tables(cells: list[Cell]) -> list[Table]:
    members = [c for c in cells if c.in_part(PART)]
    if not any(c.first("adapter") or c.setting("peft.method") for c in members):
        return []
    tables = []
    for group in group_by(members, lambda c: (c.model, c.world)).values():
        rows = []
        for c in group:
            row = planned_row(c)
            row.update(method=_method(c), trainable=_trainable(c))
            rows.append(row)
        tables.append(Table(PART, f"Full fine-tuning or an adapter? {where_ran(group[0])}", COLUMNS, rows, [
            "Same micro-batch, sequence, precision and steps in every row. MFU counts what each run computes: 6 FLOPs "
            "per trained parameter and token, 4 per frozen one (no weight gradient), plus attention.",
            "Loss after N steps: the training loss at the last step; an adapter trains a fraction of a percent of the "
            "weights, so compare held-out loss at the step count you can afford before choosing on quality.",
            "Predicted = `shardlab plan` for that run (GPU: max_memory_allocated; host: per node).",
        ]))
    return tables


def _speed(r: dict[str, Any]) -> float:
    return med(r.get("useful_tokens_per_s")) or 0.0


def _says(r: dict[str, Any]) -> str:
    loss = fmt(r.get("final_loss"), "loss")
    return (f"{r['label']} ({r['method']}) at {fmt(r.get('useful_tokens_per_s'), 'num')} tok/s in "
            f"{fmt(r.get('gpu_peak_gib'), 'gib')} GiB" + (f", loss {loss} after {r['steps']} steps" if loss else ""))


def adapter_guide(t: Table) -> list[str]:
    """What the table says, in its own numbers: the fastest full fine-tuning that ran against each adapter."""
    ok = [r for r in t.rows if r["status"].startswith("ok")]
    full = sorted((r for r in ok if r["method"] == "full"), key=_speed, reverse=True)
    adapted = sorted((r for r in ok if r["method"] != "full"), key=_speed, reverse=True)
    where = t.title.split("? ", 1)[-1]
    lines = []
    if full and adapted:
        best = full[0]
        vs = "; ".join(f"{_says(r)}: {_speed(r) / _speed(best):.2f}x its speed in "
                       f"{(med(r.get('gpu_peak_gib')) or 0) / (med(best.get('gpu_peak_gib')) or 1):.0%} of its memory"
                       for r in adapted if _speed(best))
        lines.append(f"Full fine-tuning or an adapter? ({where}): the fastest full fine-tuning that ran is {_says(best)}; {vs}.")
    elif adapted:
        failed = [r["label"] for r in t.rows if r["method"] == "full" and not r["status"].startswith("ok")]
        lines.append(f"Full fine-tuning or an adapter? ({where}): only adapters ran"
                     + (f" (full fine-tuning: {', '.join(failed)} did not)" if failed else "")
                     + f"; fastest {_says(adapted[0])}.")
    if adapted:
        lines.append("An adapter updates a fraction of the weights: pick full fine-tuning where it fits and its quality "
                     "matters, an adapter where it does not fit or where many tasks share one base.")
    return lines


def adapter_plot(tables: list[Table]) -> Plot | None:
    """Speed against GPU memory, one point per run of each adapters table: full fine-tuning, LoRA and QLoRA at once."""
    panels = [t for t in tables if t.key == PART and any(r["status"].startswith("ok") for r in t.rows)]
    if not panels:
        return None
    fig = plots.new_figure(4.6 * len(panels) + 1, 4.2)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, t in zip(axes, panels):
        methods = list(dict.fromkeys(r["method"].split(" ")[0] for r in t.rows))
        for r in (r for r in t.rows if r["status"].startswith("ok") and med(r.get("gpu_peak_gib")) is not None):
            method = r["method"].split(" ")[0]
            x, y = med(r["gpu_peak_gib"]), _speed(r)
            ax.scatter([x], [y], color=COLORS[methods.index(method) % len(COLORS)], s=40)
            ax.annotate(f"{r['label']} ({r['method']})", (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("peak GPU memory, GiB (max_memory_allocated)")
        ax.set_ylabel("useful tokens/s")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_title(t.title.split("? ", 1)[-1], fontsize=9)
    return Plot("adapters", "Full fine-tuning or an adapter?", plots.png_bytes(fig),
                "Each run's speed against its GPU memory: up and to the left is better.")


__all__ = ["adapter_tables", "adapter_guide", "adapter_plot", "PART"]
