"""A short "which strategy should I use" guide, written from the measured tables only.

Every sentence quotes a number from a table; comparisons are the equal-footing ones. Where the
tables also hold a comparison across different precision/batch/tokens (the seeds' fp32-DP artefact),
the guide says so and gives the equal-footing figure instead.
"""

from __future__ import annotations

from typing import Any

from .adapters import PART as ADAPTERS
from .adapters import adapter_guide
from .load import Cell
from .render import fmt
from .tables import Table, med


def _n(v: Any, unit: str = "", kind: str = "num") -> str:
    text = fmt(v, kind)
    return f"{text}{unit}" if text else "n/a"


def _strategies(t: Table, on_cpu: bool) -> list[str]:
    ok = [r for r in t.rows if r["status"].startswith("ok") and r.get("vs_dp") is not None]
    out: list[str] = []
    if not ok:
        return out
    baselines = [r["vs_dp_baseline"] for r in ok]
    ref_label = max(set(baselines), key=baselines.count)
    ref = next((r for r in t.rows if r["label"] == ref_label), None)
    equal = [r for r in ok if r["vs_dp_baseline"] == ref_label]
    fastest = max(equal, key=lambda r: med(r["useful_tokens_per_s"]) or 0)
    where = t.title.split(": ", 1)[-1]
    named = f" ({fastest['label']})" if fastest["label"] != fastest["strategy"] else ""
    out.append(f"**{where}** - at equal footing ({ref['precision']}, global batch {ref['global_batch']}, seq {ref['seq_len']}, "
               f"{ref['steps']} steps): fastest is **{fastest['strategy']}**{named} at "
               f"{_n(fastest['useful_tokens_per_s'], ' useful tok/s')} = {fastest['vs_dp']:.2f}x DP.")
    mem_key, mem_unit = ("gpu_peak_gib", "GiB GPU") if any(med(r.get("gpu_peak_gib")) is not None for r in equal) else ("cpu_rss_peak_gb", "GB CPU RSS")
    with_mem = [r for r in equal if med(r.get(mem_key)) is not None]
    if with_mem and ref is not None and med(ref.get(mem_key)):
        low = min(with_mem, key=lambda r: med(r[mem_key]))
        saving = (1 - med(low[mem_key]) / med(ref[mem_key])) * 100
        out.append(f"Least memory: **{low['strategy']}** at {_n(low[mem_key], kind='gib')} {mem_unit} peak ({saving:.0f}% below DP's "
                   f"{_n(ref[mem_key], kind='gib')}), running at {low['vs_dp']:.2f}x DP's speed.")
        order = sorted(with_mem, key=lambda r: -(med(r["useful_tokens_per_s"]) or 0))
        ladder = ", ".join(f"{r['strategy']} ({r['vs_dp']:.2f}x, {_n(r[mem_key], kind='gib')})" for r in order)
        out.append(f"Pick the first that fits your {'GPU' if mem_key == 'gpu_peak_gib' else 'machine'} with headroom, in speed order "
                   f"(speed vs DP, peak {mem_unit}): {ladder}.")
    flagged = [r for r in t.rows if r.get("flags")]
    if flagged:
        r = flagged[0]
        out.append(f"\u26a0 Some comparisons in this table are not on equal footing and are flagged: {r['label']} {r['flags'].split(' | ')[0]}. "
                   "Quote the equal-footing figure; the other is the artefact of comparing different precision, batch or tokens.")
    failed = [r for r in t.rows if r["status"].startswith("FAILED")]
    for r in failed:
        out.append(f"{r['label']} did not run: {r['status'][len('FAILED'):].lstrip(' :')}.")
    if on_cpu:
        out.append("These runs used CPU processes (gloo): they show how the strategies behave, not GPU speed. "
                   "Re-run the suite on your GPUs before choosing.")
    return out


def _offload(t: Table) -> list[str]:
    parts = []
    for r in t.rows:
        if r["offload"].startswith("yes") and r.get("runtime_delta_pct") is not None:
            saving = f"saved {r['mem_savings_pct']:.0f}% of peak GPU memory" if r.get("mem_savings_pct") is not None else "GPU saving not measured (CPU run)"
            parts.append(f"{r['stage']} {r['offload']}: {saving}, time per epoch {r['runtime_delta_pct']:+.0f}%"
                         + (f", CPU RSS {r['cpu_rss_delta_pct']:+.0f}%" if r.get("cpu_rss_delta_pct") is not None else ""))
    if not parts:
        return []
    return ["CPU offload: " + "; ".join(parts) + ". Offload only when the same stage without offload does not fit."]


def _pin(t: Table) -> list[str]:
    parts = [f"{r['strategy']} unpinned: time per epoch {r['runtime_delta_pct']:+.0f}%, CPU RSS {r['cpu_rss_delta_pct']:+.0f}%"
             for r in t.rows if r["pinned"] == "no" and r.get("runtime_delta_pct") is not None and r.get("cpu_rss_delta_pct") is not None]
    return ["Pinned vs pageable offload buffers (relative to pinned): " + "; ".join(parts) + "."] if parts else []


def _scaling(t: Table) -> list[str]:
    last = t.rows[-1]
    if last.get("efficiency_pct") is None:
        return []
    kind = "Weak" if t.key == "weak-scaling" else "Strong"
    return [f"{kind} scaling ({t.title.split(': ', 1)[-1]}): {last['gpus']} GPUs reach {last['efficiency_pct']:.0f}% efficiency "
            f"({last['speedup']:.2f}x the samples/s of {t.rows[0]['gpus']})."]


def _weak_scaling(t: Table) -> list[str]:
    """At the largest GPU count of a `scaling` table: the fastest strategy and mode, and the one that keeps the least
    of its smaller-count speed."""
    counts = sorted(int(c.key.rsplit("_", 1)[1]) for c in t.columns if c.key.startswith("eff_"))
    if not counts:
        return []
    n = counts[-1]
    ran = [r for r in t.rows if r.get(f"tok_s_{n}") is not None]
    if not ran:
        return []
    name = lambda r: r["strategy"] if r["mode"] == "eager" else f"{r['strategy']} {r['mode']}"  # noqa: E731
    eff = lambda r: f", {r[f'eff_{n}']:.1f}% efficiency" if r.get(f"eff_{n}") is not None else ""  # noqa: E731
    fastest = max(ran, key=lambda r: med(r[f"tok_s_{n}"]) or 0)
    where = t.title.split(": ", 1)[-1]
    line = f"**{where}** on {n} GPUs: fastest is **{name(fastest)}** at {_n(fastest[f'tok_s_{n}'], ' useful tok/s')}{eff(fastest)}"
    scored = [r for r in ran if r.get(f"eff_{n}") is not None]
    if len(scored) > 1:
        low = min(scored, key=lambda r: r[f"eff_{n}"])
        line += f"; {name(low)} keeps the least of its speed per GPU ({low[f'eff_{n}']:.1f}%)"
    return [line + "."]


def _big_model(t: Table) -> list[str]:
    """What to use for a model that does not fit, ranked by what the runs measured."""
    ok = [r for r in t.rows if r.get("mfu_pct") is not None or r.get("useful_tokens_per_s") is not None]
    if not ok:
        return []
    speed = lambda r: (r["useful_tokens_per_s"].median if r.get("useful_tokens_per_s") else 0.0)  # noqa: E731
    ok.sort(key=speed, reverse=True)

    def name(r) -> str:
        mfu = f", {r['mfu_pct'].median:.0f}% MFU" if r.get("mfu_pct") else ""
        return f"{r['label']} ({_n(speed(r))} tok/s{mfu}, host {_n(r['cpu_rss_peak_gb'].median if r.get('cpu_rss_peak_gb') else None, ' GB')})"

    exact = [r for r in ok if str(r.get("optimizer", "")).startswith("exact fp32 AdamW") and "in backward" not in str(r.get("optimizer"))]
    where = t.title.split(": ", 1)[-1]
    lines = []
    if exact:
        lines.append(f"What to use for a model that does not fit ({where}), exact AdamW: {name(exact[0])} is the fastest measured"
                     + (f"; then {', '.join(name(r) for r in exact[1:3])}" if len(exact) > 1 else "") + ".")
    other = [r for r in ok if r not in exact]
    if other:
        lines.append(f"What to use for a model that does not fit ({where}), if the optimizer may change ({other[0]['optimizer']}): "
                     f"{name(other[0])}"
                     + (" - faster than every exact option measured" if exact and speed(other[0]) > speed(exact[0]) else "") + ".")
    failed = [r["label"] for r in t.rows if r not in ok]
    if failed:
        lines.append(f"Did not complete ({where}): {', '.join(failed)} (see the runs table).")
    return lines


def guide(tables: list[Table], cells: list[Cell]) -> list[str]:
    on_cpu = bool(cells) and all(c.device_type == "cpu" for c in cells if c.ok)
    lines: list[str] = []
    for t in tables:
        if t.key == "strategies":
            lines += _strategies(t, on_cpu)
        elif t.key == "offload":
            lines += _offload(t)
        elif t.key == "pin-memory":
            lines += _pin(t)
        elif t.key == "big-model":
            lines += _big_model(t)
        elif t.key == ADAPTERS:
            lines += adapter_guide(t)
        elif t.key in ("weak-scaling", "strong-scaling"):
            lines += _scaling(t)
        elif t.key == "scaling":
            lines += _weak_scaling(t)
    if not lines:
        lines.append("Not enough runs to compare: run `shardlab bench --suite strategies` (or `--suite quick` on a CPU).")
    return lines


__all__ = ["guide"]
