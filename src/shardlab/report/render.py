"""Tables as Markdown, CSV, JSON and HTML: one set of rows, four renderings.

CSV and JSON keep raw numbers (a median and its min/max as separate fields); Markdown and HTML
show them formatted, with the min-max spread in brackets when a cell has several repeats.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
from typing import Any

from .load import Spread
from .tables import Column, Table


def _num(v: float, kind: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    if kind == "int":
        return f"{int(round(v)):,}"
    if kind == "pct":
        return f"{v:.1f}"
    if kind == "loss":  # fine-tuning moves a loss in its second decimal
        return f"{v:.4g}"
    if kind == "ratio":
        return f"{v:.2f}x"
    if kind in ("gib", "gb"):
        return f"{v:.2f}"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.2f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.3g}" if a < 10 else f"{v:.1f}"
    return f"{v:.3g}"


def fmt(value: Any, kind: str) -> str:
    if value is None:
        return ""
    if isinstance(value, Spread):
        text = _num(value.median, kind)
        if value.n > 1 and value.high != value.low:
            text += f" ({_num(value.low, kind)}\u2013{_num(value.high, kind)})"
        return text
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and kind != "text":
        return _num(float(value), kind)
    return str(value)


def table_dict(t: Table) -> dict[str, Any]:
    rows = []
    for r in t.rows:
        out = {}
        for c in t.columns:
            v = r.get(c.key)
            if isinstance(v, Spread):
                out[c.key] = v.median
                out[f"{c.key}_min"], out[f"{c.key}_max"], out[f"{c.key}_n"] = v.low, v.high, v.n
            else:
                out[c.key] = v
        rows.append(out)
    return {"key": t.key, "title": t.title, "columns": [{"key": c.key, "title": c.title} for c in t.columns],
            "rows": rows, "notes": t.notes}


def _visible(t: Table) -> list[Column]:
    """Columns with at least one value (a CPU bench has no GPU columns to show)."""
    return [c for c in t.columns if c.key in ("label", "status") or any(fmt(r.get(c.key), c.kind) for r in t.rows)]


def to_markdown(t: Table) -> str:
    cols = _visible(t)
    lines = [f"### {t.title}", "", "| " + " | ".join(c.title for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in t.rows:
        cells = [fmt(r.get(c.key), c.kind).replace("|", "\\|") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    if not t.rows:
        lines.append("| " + " | ".join("" for _ in cols) + " |")
    lines.append("")
    lines += [f"- {n}" for n in t.notes]
    return "\n".join(lines) + "\n"


def to_csv(t: Table) -> str:
    d = table_dict(t)
    keys: list[str] = []
    for r in d["rows"]:
        for k in r:
            if k not in keys:
                keys.append(k)
    if not keys:
        keys = [c.key for c in t.columns]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    for r in d["rows"]:
        w.writerow(r)
    return buf.getvalue()


def to_json(tables: list[Table]) -> str:
    return json.dumps([table_dict(t) for t in tables], indent=1, default=str)


def to_html(t: Table) -> str:
    cols = _visible(t)
    out = [f'<section class="table" id="{html.escape(t.key)}"><h3>{html.escape(t.title)}</h3>',
           f'<table data-table="{html.escape(t.key)}"><thead><tr>']
    out += [f"<th>{html.escape(c.title)}</th>" for c in cols]
    out.append("</tr></thead><tbody>")
    for r in t.rows:
        flagged = " class=\"flagged\"" if r.get("flags") else ""
        failed = " class=\"failed\"" if str(r.get("status", "")).startswith("FAILED") else flagged
        cells = []
        for c in cols:
            cls = "flag" if c.key == "flags" and r.get("flags") else ("text" if c.kind == "text" else "")
            cells.append(f"<td{f' class={chr(34)}{cls}{chr(34)}' if cls else ''}>{html.escape(fmt(r.get(c.key), c.kind))}</td>")
        out.append(f"<tr{failed}>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if t.notes:
        out.append("<ul class=\"notes\">" + "".join(f"<li>{html.escape(n)}</li>" for n in t.notes) + "</ul>")
    out.append("</section>")
    return "".join(out)


__all__ = ["fmt", "table_dict", "to_markdown", "to_csv", "to_json", "to_html"]
