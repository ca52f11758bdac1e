"""`shardlab plan`'s tables: the per-GPU plan of every strategy, where the host RAM goes, and the recommendation.

The numbers are planner.py's (a ``Plan``); this module only lays them out, so that the planner loads without rich.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .memory import CUDA_CONTEXT_BYTES, HOST_HEADROOM, RESERVED_OVER_ALLOCATED, GiB
from .budget import limiting_memory
from .planner import Plan


def render(p: Plan, console=None) -> None:
    if console is None:
        console = Console()
        if console.width < 170:
            console = Console(width=170)
    g = lambda b: "-" if b is None else f"{b / GiB:.2f}"  # noqa: E731
    console.print(
        f"[bold]{p.model}[/bold] ({p.family}, {p.n_params:,} params, largest layer {p.largest_layer_params:,}), "
        f"seq {p.seq_len}, micro {p.micro_batch} x accum {p.grad_accum}, {p.precision}, attention {p.attn_implementation}, "
        f"checkpointing {'on' if p.gradient_checkpointing else 'off'}; {p.gpus_per_node} GPU(s)/node x {p.nodes} node(s), "
        f"{p.gpu_memory / GiB:.1f} GiB per GPU ({p.gpu_memory_source})"
    )
    t = Table(title="Predicted memory per GPU (GiB; peak = max_memory_allocated)")
    own = p.micro_auto  # `--micro-batch auto`: each strategy at its own micro batch
    for col in ("strategy", *(("micro x accum",) if own else ()), "params", "grads", "optim", "activ.", "logits", "temp", "step buf",
                "peak", "fits", "headroom", "max micro", "CPU/node", "NVMe"):
        t.add_column(col, justify="right" if col != "strategy" else "left")
    for s, sp in [*p.strategies.items(), *p.adapters.items()]:  # the adapter rows last: they train adapters only
        t.add_row(
            s, *((f"{sp.micro_batch} x {sp.grad_accum}",) if own else ()),
            g(sp.gpu["parameters"]), g(sp.gpu["gradients"]), g(sp.gpu["optimizer"]), g(sp.gpu["activations"]),
            g(sp.gpu["logits (loss)"]), g(sp.gpu["temporary"]), g(sp.gpu["step buffers"]), f"[bold]{g(sp.gpu_peak)}[/bold]",
            "[green]yes[/green]" if sp.fits else "[red]no[/red]", g(sp.headroom), str(sp.max_micro_batch), g(sp.cpu_per_node),
            g(sp.nvme_per_node) if sp.nvme_per_node else "-",
        )
    console.print(t)
    pipe = next((sp for sp in p.strategies.values() if sp.stages), None)  # a pipeline's GPUs, each planned apart
    if pipe is not None:
        pt = Table(title=f"pipeline per GPU ({pipe.notes[0]})")
        for col in ("GPU", "stages", "blocks", "params", "in flight (peak)", "receive buffers", "logits kept", "peak", "at"):
            pt.add_column(col, justify="left" if col in ("blocks", "at", "stages") else "right")
        for st in pipe.stages:
            pt.add_row(str(st["gpu"]), str(st["stages"]), str(st["blocks"]), f"{st['params']:,}", str(st["peak_in_flight"]),
                       g(st["receive_buffers"]), g(st["logits_kept"]), f"[bold]{g(st['peak'])}[/bold]", st["moment"])
        console.print(pt)
        console.print("pipeline: " + "; ".join(pipe.notes[1:]) + ". It is not ranked in the recommendation: its speed is not measured.")
    console.print("'peak' is not the sum of the columns: gradients freed by zero_grad(set_to_none=True) are not yet there at the "
                  "start of backward (unless --grad-accum > 1), and step buffers exist only during the optimizer step.")
    console.print(f"Not in 'peak': CUDA context ~{CUDA_CONTEXT_BYTES / GiB:.1f} GiB per process; 'fits' also allows x{RESERVED_OVER_ALLOCATED} for "
                  "allocator fragmentation (reserved/allocated measured 1.05-1.15 on H100).")
    render_host(p, console)
    f = Table(title="Model states, bytes per parameter per GPU: ZeRO paper vs DeepSpeed's estimator vs shardlab")
    for col in ("strategy", "ZeRO paper", "DeepSpeed estimator (GPU GiB / CPU GiB per node)", "shardlab params+grads+optim", "where"):
        f.add_column(col)
    for s, sp in p.strategies.items():
        paper = "-" if sp.paper_bytes_per_param is None else f"{sp.paper_bytes_per_param:.3g}"
        ds = "-" if sp.deepspeed_gpu is None else f"{sp.deepspeed_gpu / GiB:.2f} / {sp.deepspeed_cpu / GiB:.2f}"
        f.add_row(s, paper, ds, f"{sp.model_state_bytes_per_param:.3g} ({sp.model_state_bytes_per_param * p.n_params / GiB:.2f} GiB)", sp.notes[0])
    console.print(f)
    console.print("Why they differ: the paper counts model states only (16 B/param: 2 fp16 params + 2 fp16 grads + 12 fp32 "
                  "master/m/v); DeepSpeed's estimator adds 4 B/param of fp32 grads on the GPU (2+18/N) and 4 x largest layer for "
                  "ZeRO-3, and multiplies CPU by 1.5; shardlab's dp keeps fp32 weights (autocast), so 4+4+8; none of the "
                  "model-state formulas count activations, the loss' logits or communication buckets, which the peak column does.")
    for note in p.notes:
        console.print(f"[bold yellow]Note:[/bold yellow] {note}")
    if p.recommended_flags and p.recommended_plan is not None:
        sp = p.recommended_plan
        console.print(f"[bold green]Recommendation:[/bold green] {p.recommended_flags} - {p.reason}. "
                      f"Predicted: GPU peak {g(sp.gpu_peak)} GiB, host {g(sp.cpu_per_node)} GiB per node.")
    elif p.recommendation:
        rec = p.strategies[p.recommendation]
        at = f" at micro {rec.micro_batch} x accum {rec.grad_accum}" if p.micro_auto else ""
        console.print(f"[bold green]Recommendation:[/bold green] {p.recommendation}{at} - {p.reason}. "
                      f"Largest micro batch that fits: {rec.max_micro_batch}."
                      + (f" Next fastest that fits: {p.next_option}." if p.next_option else ""))
    else:
        console.print(f"[bold red]Nothing fits:[/bold red] {p.reason}. Next: {p.next_option}.")


def render_host(p: Plan, console) -> None:
    """Where the host RAM goes, buffer by buffer, for the strategies whose host figure decides something: the recommended
    one and those that do not fit for host RAM (``limiting_memory``). Nothing for runs that keep nothing but the process there."""
    shown = [s for s, sp in p.strategies.items()
             if (s == p.recommendation or (limiting_memory(sp) == "host RAM" and not sp.fits)) and len(sp.cpu_detail) > 2]
    if not shown:
        return
    t = Table(title="Host memory per node (GiB), the CPU/node column's parts"
                    + (f"; fits when {HOST_HEADROOM} x peak <= {p.host_ram / GiB:.1f}" if p.host_ram else ""))
    for col in ("strategy", "buffer", "GiB"):
        t.add_column(col, justify="right" if col == "GiB" else "left")
    for s in shown:
        sp = p.strategies[s]
        rows = [(name, nbytes) for name, nbytes in sp.cpu_detail.items() if nbytes]
        for i, (name, nbytes) in enumerate(rows):
            t.add_row(s if i == 0 else "", name, f"{nbytes / GiB:.2f}")
        t.add_row("", "[bold]peak per node[/bold] (the larger of the build moment and training)",
                  f"[bold]{sp.cpu_per_node / GiB:.2f}[/bold]", end_section=True)
    console.print(t)
