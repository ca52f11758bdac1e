"""Pipeline-parallel schedule simulator: event timelines, metrics and diagrams.

    from shardlab.pipesim import simulate
    tl = simulate("1f1b", stages=4, microbatches=8)
    tl.metrics["bubble_fraction"], tl.events[0], print(tl.ascii())
"""

from .schedules import SCHEDULES, Action, device_orders
from .simulator import Event, Timeline, simulate


def render_timeline(timeline, path, **kwargs):
    """Draw `timeline` to `path` (.png or .svg; no suffix: both). Returns the files written."""
    from .diagrams import render_timeline as _render  # matplotlib loads only when drawing

    return _render(timeline, path, **kwargs)


def tutorial_diagrams(out_dir):
    """The five tutorial figures (PNG + SVG) into `out_dir`. Returns the files written."""
    from .diagrams import tutorial_diagrams as _tutorial  # as above

    return _tutorial(out_dir)


__all__ = ["SCHEDULES", "Action", "Event", "Timeline", "device_orders", "render_timeline", "simulate", "tutorial_diagrams"]
