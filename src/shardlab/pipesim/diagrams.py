"""Matplotlib figures of simulated timelines (Agg backend: no display needed).

render_timeline: device x time; forwards blue, backwards orange (under a split backward, zbv:
input gradients orange, weight gradients green), lighter shades = later chunks, micro-batch
numbers in the boxes, idle time hatched grey so the bubble is visible. tutorial_diagrams: the five figures a pipeline-parallelism tutorial needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from .schedules import SYNCHRONOUS
from .simulator import simulate

if TYPE_CHECKING:
    from .simulator import Timeline

# Per chunk shades: chunk 0 strongest. Forward blue, backward orange (colour-blind safe pair).
F_COLOURS = ["#1f77b4", "#6baed6", "#9ecae1", "#c6dbef"]
B_COLOURS = ["#e6550d", "#fd8d3c", "#fdae6b", "#fdd0a2"]
W_COLOURS = ["#31a354", "#74c476", "#a1d99b", "#c7e9c0"]  # weight gradients (split backward): green
KIND_COLOURS = {"F": F_COLOURS, "B": B_COLOURS, "I": B_COLOURS, "W": W_COLOURS}
IDLE = "#d9d9d9"
NAMES = {
    "naive": "Naive model parallelism",
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved 1F1B",
    "zbv": "Zero-bubble V (ZBV)",
    "pipedream": "PipeDream (async 1F1B, weight stashing)",
    "pipedream-2bw": "PipeDream-2BW",
}


def _version_colour(v: int):
    # tab20's dark shades for versions 0-9, its light twins for 10-19: neighbours stay distinct
    return plt.get_cmap("tab20")(2 * (v % 10) + (v // 10) % 2)


def _save(fig, path: str | Path) -> list[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    targets = [path] if path.suffix.lower() in (".png", ".svg") else [path.with_suffix(".png"), path.with_suffix(".svg")]
    for t in targets:
        fig.savefig(t, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return targets


def _title(tl: "Timeline") -> str:
    m = tl.metrics
    shape = f"{tl.stages} devices"
    if tl.schedule != "naive":
        shape += f", {tl.microbatches} micro-batches"
    else:
        shape += ", one batch"
    if tl.chunks > 1:
        shape += f", {tl.chunks} chunks/device" + (" in a V" if tl.schedule == "zbv" else "")
    if tl.steps > 1:
        shape += f", {tl.steps} steps"
    return (
        f"{NAMES[tl.schedule]}: {shape}\n"
        f"utilisation {m['mean_utilisation']:.1%}, bubble {m['bubble_fraction']:.1%}, "
        f"throughput {m['throughput_vs_naive']:.2f}x naive"
    )


def draw_timeline(
    ax,
    tl: "Timeline",
    kinds: Iterable[str] = ("F", "B", "I", "W"),
    until: float | None = None,
    colour_by: str = "kind",
    show_version: bool = False,
) -> None:
    """Draw onto `ax`. colour_by='version' colours boxes by weight version (PipeDream figure)."""
    kinds = set(kinds)
    span = until if until is not None else tl.makespan
    P = tl.stages
    for d in range(P):  # idle background: whatever no box covers is bubble
        ax.add_patch(Rectangle((0, d - 0.4), span, 0.8, facecolor=IDLE, edgecolor="none", hatch="///", alpha=0.6, zorder=0))
    # Roughly how many points one time unit spans, to skip labels that would not fit.
    fig_w_pt = ax.figure.get_size_inches()[0] * 72 * 0.85
    pt_per_unit = fig_w_pt / span
    for e in tl.events:
        if e.kind not in kinds or e.start >= span or e.duration <= 0:  # zbv's first stage runs an empty I
            continue
        if colour_by == "version":
            face = _version_colour(e.version)
        else:
            face = KIND_COLOURS[e.kind][min(e.chunk, 3)]
        ax.add_patch(Rectangle((e.start, e.device - 0.4), e.duration, 0.8, facecolor=face, edgecolor="black", linewidth=0.6, zorder=2))
        box_pt = e.duration * pt_per_unit
        label = "batch" if tl.schedule == "naive" else str(e.microbatch)
        if e.kind in ("I", "W"):
            label = f"{e.kind}{label}"
        if colour_by == "version":
            label = f"{e.kind}{label}"
        if show_version:
            label += f"\nv{e.version}"
        size = min(10.0, box_pt / (0.62 * max(len(s) for s in label.split("\n")) + 0.5))
        if size >= 4.5:
            ax.text(e.start + e.duration / 2, e.device, label, ha="center", va="center", fontsize=size, color="white" if e.chunk == 0 or colour_by == "version" else "black", zorder=3)
    ax.set_xlim(0, span)
    ax.set_ylim(P - 0.5, -0.5)  # device 0 on top, like the papers
    ax.set_yticks(range(P), [f"device {d}\n{u:.0%} busy" for d, u in enumerate(tl.metrics["utilisation"])])
    ax.set_xlabel("time (units: 1 = one micro-batch forward through one equal stage, unless set with --fwd/--bwd)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5, zorder=1)
    ax.set_axisbelow(True)


def _legend_handles(tl: "Timeline", kinds: Iterable[str] = ("F", "B", "I", "W")) -> list[Patch]:
    handles = []
    present = {e.kind for e in tl.events} & set(kinds)
    names = {"F": "forward", "B": "backward", "I": "backward: input gradient (I)", "W": "backward: weight gradient (W)"}
    for c in range(tl.chunks):
        suffix = f" (chunk {c})" if tl.chunks > 1 else ""
        for kind in ("F", "B", "I", "W"):
            if kind in present:
                handles.append(Patch(facecolor=KIND_COLOURS[kind][min(c, 3)], edgecolor="black", label=f"{names[kind]}{suffix}"))
    handles.append(Patch(facecolor=IDLE, edgecolor="grey", hatch="///", label="idle (bubble)"))
    return handles


def render_timeline(tl: "Timeline", path: str | Path, title: str | None = None, **draw_kwargs) -> list[Path]:
    """Timeline figure of `tl` to `path` (.png / .svg, or both when `path` has no suffix)."""
    width = min(22.0, max(8.0, tl.makespan * 0.3))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.55 * tl.stages + 0.8))
    draw_timeline(ax, tl, **draw_kwargs)
    ax.set_title(title or _title(tl))
    if draw_kwargs.get("colour_by") == "version":
        versions = sorted({e.version for e in tl.events})
        handles = [Patch(facecolor=_version_colour(v), edgecolor="black", label=f"weights v{v}") for v in versions[:20]]
        handles.append(Patch(facecolor=IDLE, edgecolor="grey", hatch="///", label="idle (bubble)"))
    else:
        handles = _legend_handles(tl, draw_kwargs.get("kinds", ("F", "B", "I", "W")))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def utilisation_chart(timelines: list["Timeline"], path: str | Path, title: str) -> list[Path]:
    """Bar chart: mean utilisation per schedule, annotated with throughput relative to naive."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    short = {"naive": "naive", "interleaved-1f1b": "interleaved\n1F1B", "zbv": "ZBV"}
    names = [short.get(t.schedule, NAMES[t.schedule].split(" (")[0]) + (f" (V={t.chunks})" if t.chunks > 1 else "") for t in timelines]
    utils = [t.metrics["mean_utilisation"] * 100 for t in timelines]
    colours = ["#969696" if t.schedule == "naive" else "#1f77b4" if t.schedule in SYNCHRONOUS else "#31a354" for t in timelines]
    bars = ax.bar(names, utils, color=colours, edgecolor="black")
    for bar, t in zip(bars, timelines):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 1, f"{bar.get_height():.0f}%\n{t.metrics['throughput_vs_naive']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 115)
    ax.set_ylabel("mean device utilisation (%)")
    ax.set_title(title)
    ax.legend(
        handles=[
            Patch(facecolor="#969696", label="no pipelining"),
            Patch(facecolor="#1f77b4", label="synchronous (flush every step)"),
            Patch(facecolor="#31a354", label="asynchronous (no flush, stale weights)"),
        ],
        loc="upper left",
        fontsize=8,
        frameon=False,
    )
    ax.text(0.99, 0.97, "label: utilisation / throughput vs naive", transform=ax.transAxes, ha="right", va="top", fontsize=8, color="dimgray")
    return _save(fig, path)


def tutorial_diagrams(out_dir: str | Path) -> list[Path]:
    """The five tutorial figures, each as PNG and SVG. Equal stages, fwd 1 / bwd 2, no comm."""
    out = Path(out_dir)
    files: list[Path] = []
    # 1. Naive model parallelism: one device works at a time -> 1/P = 25% for 4 devices.
    naive = simulate("naive", 4, 1)
    files += render_timeline(naive, out / "tutorial_1_naive", title=f"Naive model parallelism, 4 devices: only one works at a time\nutilisation {naive.metrics['mean_utilisation']:.0%}, bubble {naive.metrics['bubble_fraction']:.0%} = (P-1)/P")
    # 2./3. Micro-batches (GPipe): the forward fill, then the full forward + backward.
    gp = simulate("gpipe", 4, 4)
    fwd_end = max(e.end for e in gp.events if e.kind == "F")
    files += render_timeline(gp, out / "tutorial_2_microbatch_forward", kinds=("F",), until=fwd_end, title="Micro-batches, forward: 4 micro-batches flow through 4 devices\nthe pipeline fills diagonally; each device idles (P-1) forward slots")
    b = gp.metrics["bubble_fraction"]
    files += render_timeline(gp, out / "tutorial_3_microbatch_backward", title=f"Micro-batches, forward then backward (GPipe, 4 devices, 4 micro-batches)\nbackwards drain in reverse stage order; bubble (P-1)/(M+P-1) = 3/7 = {b:.1%}")
    # 4. PipeDream weight versions: no flush, every backward updates, forwards stash their weights.
    pd = simulate("pipedream", 4, 4, steps=3)
    held = ", ".join(f"dev{d}: {v}" for d, v in enumerate(pd.metrics["weight_versions"]))
    files += render_timeline(pd, out / "tutorial_4_pipedream_weight_versions", colour_by="version", show_version=True, title=f"PipeDream weight versioning: colour = weight version a micro-batch uses (its B reuses its F's stash)\nversions held per device ({held}) = P - stage; staleness on device i = P-1-i updates")
    # 5. Utilisation across schedules, same work: 4 devices, 8 micro-batches, 4 optimizer steps.
    kw = dict(stages=4, microbatches=8, steps=4)
    tls = [simulate(s, chunks=2 if s == "interleaved-1f1b" else 1, **kw) for s in ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zbv", "pipedream", "pipedream-2bw")]
    files += utilisation_chart(tls, out / "tutorial_5_utilisation_comparison", "Device utilisation by schedule: 4 devices, 8 micro-batches/step, 4 steps, fwd 1 / bwd 2 (zbv: I 1, W 1)")
    return files
