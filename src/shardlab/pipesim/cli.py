"""`shardlab pipeline simulate`: argument parsing and the terminal report (library calls only)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .schedules import SCHEDULES
from . import render_timeline, simulate, tutorial_diagrams


def add_pipeline_parser(sub, parser_class) -> None:
    """Register `pipeline simulate` on the top-level subparsers `sub`."""
    pl = sub.add_parser("pipeline", help="pipeline-parallel schedule tools")
    psub = pl.add_subparsers(dest="pipeline_command", metavar="simulate", required=True, parser_class=parser_class)
    sim = psub.add_parser("simulate", help="simulate a pipeline schedule: timeline, bubble, memory, staleness, diagrams")
    sim.add_argument("--stages", "-P", type=int, default=4, help="pipeline stages = devices (default 4)")
    sim.add_argument("--microbatches", "-M", type=int, default=8, help="micro-batches per step (default 8)")
    sim.add_argument("--schedule", "-s", default="1f1b", help=f"one of {', '.join(SCHEDULES)} (default 1f1b)")
    sim.add_argument("--chunks", "-V", type=int, default=1, help="model chunks per device, interleaved-1f1b only; zbv always has 2 (default 1)")
    sim.add_argument("--fwd", default="1", help="forward time of one micro-batch per stage: a number or a list, e.g. 1,1,2,1 (one per "
                     "device, its chunks sharing it equally, or one per virtual stage) (default 1)")
    sim.add_argument("--bwd", default="2", help="backward time per stage: a number or a list (default 2)")
    sim.add_argument("--wgrad", default=None, help="zbv: the weight gradient's (W's) share of each backward, the rest being the input "
                     "gradient (I): a number or a list (default 0.5: I and W cost the same; the first stage's backward is all W)")
    sim.add_argument("--comm", type=float, default=0.0, help="delay to send activations/gradients between devices (default 0)")
    sim.add_argument("--steps", type=int, default=None, help=f"optimizer steps to simulate (default {DEFAULT_STEPS_ASYNC} for "
                     f"{' and '.join(ASYNC_SCHEDULES)}, whose steps overlap; else 1)")
    sim.add_argument("--layers", type=int, default=None, help="model layers: checks that every stage gets one")
    sim.add_argument("--out", default=None, help="directory for timeline.png/.svg, timeline.json and the tutorial diagrams")
    sim.add_argument("--no-tutorial", action="store_true", help="with --out: skip the five tutorial diagrams")
    sim.add_argument("--no-ascii", action="store_true", help="do not print the ASCII timeline")


def cmd_pipeline(args: argparse.Namespace) -> None:
    steps = args.steps if args.steps is not None else (DEFAULT_STEPS_ASYNC if args.schedule in ASYNC_SCHEDULES else 1)
    tl = simulate(args.schedule, args.stages, args.microbatches, fwd=args.fwd, bwd=args.bwd, comm=args.comm, chunks=args.chunks, steps=steps, layers=args.layers,
                  wgrad=args.wgrad)
    print(report(tl))
    if args.schedule in ASYNC_SCHEDULES:
        print(_async_note(args.schedule, steps, args.steps is None))
    if not args.no_ascii:
        print()
        print(tl.ascii())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = render_timeline(tl, out / "timeline")
        (out / "timeline.json").write_text(json.dumps(tl.to_dict(), indent=1))
        files.append(out / "timeline.json")
        if not args.no_tutorial:
            files += tutorial_diagrams(out)
        print()
        for f in files:
            print(f"wrote {f}")


# PipeDream's schedules differ from 1F1B only between steps (no flush: the next step's forwards fill the drain) and
# in the weights a micro-batch uses (stashed versions): one step alone draws the same timeline as 1F1B.
ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")
DEFAULT_STEPS_ASYNC = 3


def _async_note(schedule: str, steps: int, defaulted: bool) -> str:
    if steps == 1:
        return (f"note: one step of {schedule} runs micro-batches in 1F1B's order, so its timeline equals 1f1b's; what differs is "
                "the weights (the versions and staleness columns) and, from the second step on, no flush between steps: "
                f"use --steps {DEFAULT_STEPS_ASYNC}")
    why = f"{steps} steps (the default for {schedule}: one step alone looks like 1f1b)" if defaulted else f"{steps} steps"
    return (f"note: {why}: no flush between steps, the next step's forwards fill the previous one's drain; each forward "
            "stashes the weights its backward reuses (the versions and staleness columns)")


def report(tl) -> str:
    m = tl.metrics
    fmt = lambda xs: ",".join(f"{x:g}" for x in xs)  # noqa: E731
    head = f"{tl.schedule}: {tl.stages} stages x {tl.microbatches} micro-batches"
    split = tl.wgrad is not None
    if tl.chunks > 1:
        head += f", {tl.chunks} chunks/device" + (" (V placement)" if tl.schedule == "zbv" else "")
    head += f", {tl.steps} step(s); fwd {fmt(tl.fwd)}  bwd {fmt(tl.bwd)}  comm {tl.comm:g}"
    if split:
        head += f"; W share of backward {fmt(tl.wgrad)} (per virtual stage)"
    lines = [head]
    bubble = f"bubble {m['bubble_fraction']:.2%} (idle / (P x makespan))"
    if m["bubble_theory"] is not None:
        bubble += f", closed form {m['bubble_theory']:.2%}"
    lines.append(f"makespan {m['makespan']:g}   {bubble}")
    lines.append(f"throughput {m['throughput_vs_naive']:.2f}x naive ({m['microbatches_per_time']:.3f} micro-batches per time unit; naive makespan {m['naive_makespan']:g})")
    lines.append("")
    pending = f" {'W pending':>10}" if split else ""
    lines.append(f"{'device':>6} {'busy':>8} {'idle':>8} {'util':>7} {'peak in-flight':>15} {'activations':>12}{pending} {'weight versions':>16} {'max staleness':>14}")
    for d in range(tl.stages):
        pending = f" {m['peak_w_pending'][d]:>10}" if split else ""
        lines.append(
            f"{d:>6} {m['busy'][d]:>8g} {m['idle'][d]:>8g} {m['utilisation'][d]:>7.1%} {m['peak_inflight'][d]:>15} "
            f"{m['peak_activations'][d]:>12g}{pending} {m['weight_versions'][d]:>16} {m['max_staleness'][d]:>14}"
        )
    lines.append("activations: peak held, in micro-batches through the device's whole share of layers; staleness: weight updates missed vs sequential SGD")
    if split:
        lines.append("W pending: peak (micro-batch, chunk)s past their I still waiting for their W, which keep their activations and "
                     "the gradients at each weight's output until then (counted in activations too)")
    return "\n".join(lines)
