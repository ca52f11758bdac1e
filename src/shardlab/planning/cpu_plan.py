"""`shardlab plan --device cpu`: the host memory of a CPU run under every strategy, and the one to use.

On a CPU device the host holds everything a GPU would: weights, gradients, optimizer states and activations of every
rank, so the one figure that decides is the whole run's host memory against this node's RAM. It is the same
prediction `shardlab train` checks before it starts a CPU run (run_plan.predict_run / check_host_ram), made for each
strategy, with the reason a strategy cannot run on a CPU where it cannot (the same checks `train` makes first).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..config import RunConfig
from ..errors import UserError
from ..specs.registry import all_specs, speed_order
from .memory import HOST_HEADROOM, host_fits
from .run_plan import check_host_ram, predict_run


@dataclass
class CpuRow:
    strategy: str
    host_gib: float | None = None  # the whole run (all ranks) at its peak
    per_rank_gib: float | None = None  # one rank's allocations, without the process baseline
    heap_kept_gib: float | None = None  # what the ranks' heaps keep beyond their allocations (in host_gib)
    heap_reuse: bool | None = None  # freed memory kept for the next step (faster), or glibc's default where only it fits
    fits: bool | None = None
    peak_moment: str | None = None
    refused: str | None = None  # why the strategy cannot run this configuration on a CPU


@dataclass
class CpuPlan:
    model: str
    ranks: int
    micro_batch: int
    grad_accum: int
    precision: str
    host_ram_gib: float
    rows: list[CpuRow]
    recommendation: str | None
    fix: str | None = None  # when nothing fits: what the fastest planned strategy would need (check_host_ram's hint)
    fix_for: str | None = None  # that strategy
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def plan_cpu(cfg: RunConfig, nproc: int, host_ram_gib: float, check: Callable[[RunConfig], Any]) -> CpuPlan:
    """Every registered strategy's CPU run of ``cfg`` on ``nproc`` ranks against ``host_ram_gib``. ``check`` is the
    launcher's preflight (a UserError for what the strategy refuses); the recommendation is the fastest that fits."""
    if cfg.micro_batch == "auto":
        raise UserError("a CPU plan needs a micro batch", "pass --micro-batch N; the plan then says which strategies fit")
    rows, record = [], {}
    for s in all_specs():
        # as `train` makes it: a pipeline without --microbatches gets its default micro-batches per stage
        one = cfg.model_copy(update={"strategy": s.name, "gpus": nproc}).with_pipeline_microbatches(nproc * cfg.nodes)[0]
        row = CpuRow(s.name)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its notes are for a run (and would break --json)
                check(one)
        except UserError as err:
            row.refused = str(err)
            rows.append(row)
            continue
        rec = predict_run(one, "cpu", nproc, host_ram=host_ram_gib)
        if rec.get("error") or rec.get("cpu_gib") is None:
            row.refused = f"not planned: {rec.get('error')}"
        else:
            record[s.name] = rec
            row.host_gib, row.per_rank_gib, row.peak_moment = rec["cpu_gib"], rec["per_rank_gib"], rec["peak_moment"]
            row.heap_kept_gib, row.heap_reuse = rec["heap_kept_gib"], rec["heap_reuse"]
            row.fits = host_fits(rec["cpu_gib"], host_ram_gib)
        rows.append(row)
    by_name = {r.strategy: r for r in rows}
    best = next((s for s in speed_order() if by_name[s].fits), None)
    planned = [s for s in speed_order() if s in record]
    first = record[planned[0]] if planned else {}
    out = CpuPlan(cfg.model, nproc, first.get("micro_batch", 0), first.get("grad_accum", 0), first.get("precision", "?"),
                  round(host_ram_gib, 1), rows, best)
    if best is None and planned:  # what the fastest would need: the fix `train` would print
        try:
            check_host_ram(cfg.model_copy(update={"strategy": planned[0], "gpus": nproc}), record[planned[0]], "cpu", nproc,
                           available_gib=host_ram_gib)
        except UserError as err:
            out.fix, out.fix_for = err.hint, planned[0]
    out.notes.append(f"fits: {HOST_HEADROOM} x the predicted peak within this node's RAM; offload strategies move "
                     "nothing off a CPU device (they run, for testing, with the same host memory)")
    # planning/host.heap_kept_bytes; benchmarks/results/*-cpu-host-model
    out.notes.append("heap: what glibc keeps resident beyond the allocations, an allowance fitted to gpt2 runs (the largest "
                     "measured); 'reuse' keeps freed memory for the next step (steps 12-22% shorter measured), 'glibc' "
                     "gives it back where only that fits; checked against gpt2 (124M) on one rank: 2-26% above the "
                     "measured resident peak")
    return out


def render_cpu(p: CpuPlan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=170)
    console.print(f"[bold]{p.model}[/bold] on the CPU: {p.ranks} rank(s), micro {p.micro_batch} x accum {p.grad_accum}, "
                  f"{p.precision}; {p.host_ram_gib:.1f} GiB of host RAM")
    t = Table(title="Predicted host memory of the whole CPU run (GiB)")
    for col in ("strategy", "run (all ranks)", "per rank", "heap", "fits", "peak at / why not"):
        t.add_column(col, justify="left" if col in ("strategy", "peak at / why not") else "right")
    g = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in p.rows:
        fits = "-" if r.fits is None else ("[green]yes[/green]" if r.fits else "[red]no[/red]")
        heap = "-" if r.heap_kept_gib is None else f"{r.heap_kept_gib:.2f} {'reuse' if r.heap_reuse else 'glibc'}"
        t.add_row(r.strategy, g(r.host_gib), g(r.per_rank_gib), heap, fits, r.refused or r.peak_moment or "")
    console.print(t)
    for n in p.notes:
        console.print(n)
    if p.recommendation:
        console.print(f"[bold]Recommended:[/bold] {p.recommendation} (the fastest that fits this node's RAM)")
    else:
        console.print("[bold]Nothing fits[/bold] this node's RAM" + (f"; for {p.fix_for}, `shardlab train` would "
                                                                     f"suggest: {p.fix}" if p.fix else ""))
