"""`shardlab report RUN_DIRS...`: the seed tutorials' tables, plots and one HTML page, from run directories only.

    from shardlab.report import write_report
    write_report(["runs/bench-quick"], "runs/bench-quick/report")

Writes into the output directory::

    report.md          every table (Markdown), the guide, links to the plots
    report.html        the same, self-contained (plots embedded as base64 PNG): open it in a browser
    tables.json        every table with raw numbers (medians, min, max, repeats)
    tables/KEY-N.csv   one CSV per table
    plots/NAME.png     the figures

It never trains: it reads summary.json, config.yaml, metrics.jsonl, gpu_memory.csv and
cpu_memory.csv (and bench.json for a bench's cells, failures and parts).
"""

from __future__ import annotations

import base64
import html
import shutil
from datetime import datetime
from pathlib import Path

from ..errors import UserError
from .guide import guide
from .load import Cell, load
from .plots import Plot, all_plots
from .render import to_csv, to_html, to_json, to_markdown
from . import tables as _tables
from .adapters import adapter_plot, adapter_tables
from .memory import big_model_tables, memory_tables, plan_tables
from .scaling import scaling_tables, weak_scaling_tables
from .tables import Table

# Tables and plots a suite's own module builds on tables.py and plots.py (which cannot import them back)
SUITE_TABLES = (adapter_tables,)
SUITE_PLOTS = (adapter_plot,)
# The tables of every module built on tables.py, in the seed tutorials' order, which puts them between its offload and
# eval tables: a suite's own after the big-model table
OTHER_TABLES = (big_model_tables, *SUITE_TABLES, scaling_tables, weak_scaling_tables, memory_tables, plan_tables)


def build_tables(cells: list[Cell]) -> list[Table]:
    """Every table the runs support (tables.build_tables), the suites' own included."""
    return _tables.build_tables(cells, OTHER_TABLES)

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0;font-size:.85rem}
th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:right;vertical-align:top}
th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}
td.text{text-align:left}td.flag{background:#fff4d6;text-align:left}tr.failed td{background:#fde2e2}
.notes{font-size:.8rem;color:#555}figure{margin:1rem 0}figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.8rem;color:#555}.guide li{margin:.3rem 0}
"""


def build(paths: list[str | Path]) -> tuple[list[Cell], list[Table], list[Plot], list[str]]:
    """Everything a report holds, in memory."""
    if not paths:
        raise UserError("no run or bench directories given", "pass e.g. `shardlab report runs/bench-quick`")
    cells = load(paths)
    if not cells:
        raise UserError("the given directories hold no runs", "pass the directory `shardlab bench` or `shardlab train` wrote")
    tables = build_tables(cells)
    plots = all_plots(cells, tables) + [p for draw in SUITE_PLOTS if (p := draw(tables)) is not None]
    return cells, tables, plots, guide(tables, cells)


def _table_files(tables: list[Table]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for t in tables:
        seen[t.key] = seen.get(t.key, 0) + 1
        names.append(f"{t.key}-{seen[t.key]}.csv" if seen[t.key] > 1 or sum(x.key == t.key for x in tables) > 1 else f"{t.key}.csv")
    return names


def markdown(cells: list[Cell], tables: list[Table], plots: list[Plot], advice: list[str], sources: list[str]) -> str:
    n_ok = sum(c.ok for c in cells)
    failed = [c for c in cells if not c.ok]
    out = ["# shardlab report", "", f"Generated {datetime.now():%Y-%m-%d %H:%M} from {', '.join(sources)}: "
           f"{len(cells)} configurations, {n_ok} ran, {len(failed)} failed.", "",
           "Comparisons are made only between runs on equal footing (same precision, global batch, sequence length and "
           "tokens); any other comparison is flagged \u26a0 with the equal-footing figure next to it.", "",
           "## Which strategy should I use?", ""]
    out += [f"- {line}" for line in advice]
    out.append("")
    out.append("## Tables")
    out.append("")
    for t in tables:
        out.append(to_markdown(t))
    if plots:
        out += ["## Plots", ""]
        out += [f"![{p.title}](plots/{p.name}.png)\n\n{p.caption}\n" for p in plots]
    return "\n".join(out)


def html_page(cells: list[Cell], tables: list[Table], plots: list[Plot], advice: list[str], sources: list[str]) -> str:
    """One self-contained page: inline CSS, tables, plots as data: URIs; no scripts, nothing fetched."""
    n_ok = sum(c.ok for c in cells)
    esc = html.escape
    parts = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>shardlab report</title>",
             f"<style>{CSS}</style></head><body><h1>shardlab report</h1>",
             f"<p>Generated {datetime.now():%Y-%m-%d %H:%M} from {esc(', '.join(sources))}: {len(cells)} configurations, "
             f"{n_ok} ran, {len(cells) - n_ok} failed. Comparisons are made only between runs on equal footing (same precision, "
             "global batch, sequence length and tokens); any other comparison is flagged \u26a0 (highlighted) with the "
             "equal-footing figure next to it.</p>",
             "<h2>Which strategy should I use?</h2><ul class=\"guide\">"]
    parts += [f"<li>{_inline_md(line)}</li>" for line in advice]
    parts.append("</ul><h2>Tables</h2>")
    parts += [to_html(t) for t in tables]
    if plots:
        parts.append("<h2>Plots</h2>")
        for p in plots:
            data = base64.b64encode(p.png).decode()
            parts.append(f'<figure id="plot-{esc(p.name)}"><img alt="{esc(p.title)}" src="data:image/png;base64,{data}">'
                         f"<figcaption>{esc(p.caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "".join(parts)


def _inline_md(text: str) -> str:
    """The guide's **bold** as <b>, everything else escaped."""
    pieces = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(pieces))


def write_report(paths: list[str | Path], output_dir: str | Path) -> dict[str, Path]:
    """Write report.md, report.html, tables.json, tables/*.csv and plots/*.png into ``output_dir``."""
    cells, tables, plots, advice = build(paths)
    out = Path(output_dir)
    for sub in ("tables", "plots"):
        shutil.rmtree(out / sub, ignore_errors=True)  # a re-run must not keep the previous report's files
        (out / sub).mkdir(parents=True, exist_ok=True)
    sources = [str(p) for p in paths]
    for t, name in zip(tables, _table_files(tables)):
        (out / "tables" / name).write_text(to_csv(t))
    for p in plots:
        (out / "plots" / f"{p.name}.png").write_bytes(p.png)
    (out / "tables.json").write_text(to_json(tables))
    (out / "report.md").write_text(markdown(cells, tables, plots, advice, sources))
    (out / "report.html").write_text(html_page(cells, tables, plots, advice, sources))
    return {"markdown": out / "report.md", "html": out / "report.html", "json": out / "tables.json", "dir": out}


__all__ = ["write_report", "build", "load", "build_tables"]
