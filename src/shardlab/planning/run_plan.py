"""The plan of one run: `shardlab train` asks the planner about its own config before any worker starts.

On a GPU the prediction is checked against the device: when it does not fit, one warning line names
the predicted need, the GPU's memory and what the plan says would fit (a smaller micro batch with the
global batch kept, gradient checkpointing, or the fastest strategy that fits). The run still starts:
the plan is a prediction, the run is the measurement. On a CPU the prediction is only recorded.

The record is written into the run's summary.json under ``plan`` (``PLAN_KEYS`` always present, read by
report code; the rest is for people):
    gpu_peak_gib  predicted peak torch.cuda.max_memory_allocated per GPU (null on CPU)
    cpu_gib       predicted host memory per node (on CPU: of the whole run, all ranks)
    cpu_gib_cached  --compile on GPUs: the same once inductor's cache holds every graph (its workers compile nothing)
    fits          GPU: fits with the CUDA context and the fragmentation allowance; null on CPU
    strategy      the strategy it was made for
A planning failure never stops a run: the record then carries ``error`` and nulls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import psutil

from .. import messages
from ..config import RunConfig
from ..errors import UserError
from ..measure.records import read_json, write_text_atomic
from ..specs.registry import spec, speed_order
from .memory import CUDA_CONTEXT_BYTES, HOST_HEADROOM, RESERVED_OVER_ALLOCATED, GiB, host_fits
from .microbatch import largest_that_fits, micro_candidates

# Function-local imports below are lazy on purpose: torch, training.optim and the planner's modules (torch, transformers)
# load only when a prediction is made; the worker (read_record) and the CLI (host_ram_gib) import this module without them.

if TYPE_CHECKING:
    from ..runtime.resolved import ResolvedRun

PLAN_KEYS = ("gpu_peak_gib", "cpu_gib", "fits", "strategy")


def _gib(x: float | None) -> float | None:
    return None if x is None else round(x / GiB, 4)


def gpu_memory_gib(nproc: int) -> float:
    """The smallest total memory among the GPUs this node's ranks will use (0..nproc-1 of the visible ones)."""
    import torch

    n = max(1, min(nproc, torch.cuda.device_count()))
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) / GiB


def host_ram_gib() -> float:
    return psutil.virtual_memory().total / GiB


def predict_run(cfg: RunConfig, device_type: str, nproc: int, *, gpu_memory: float | None = None,
                host_ram: float | None = None, eval_blocks: int | None = None, precision: str | None = None) -> dict[str, Any]:
    """The plan record of ``cfg`` (an integer micro batch) on ``nproc`` ranks per node of ``device_type``.
    ``gpu_memory`` / ``host_ram`` in GiB: detected when omitted. ``eval_blocks``: the eval split's size, when known
    (``with_eval_split``)."""
    record: dict[str, Any] = {"gpu_peak_gib": None, "cpu_gib": None, "fits": None, "strategy": cfg.strategy, "device": device_type}
    try:
        record.update(_predict(cfg, device_type, nproc, gpu_memory, host_ram, eval_blocks, precision))
    except UserError as err:
        record["error"] = err.message
    except Exception as err:  # noqa: BLE001 - a planner bug must not stop a training run; it is recorded instead
        record["error"] = f"{type(err).__name__}: {err}"
    return record


def _predict(cfg: RunConfig, device_type: str, nproc: int, gpu_memory: float | None, host_ram: float | None,
             eval_blocks: int | None = None, precision: str | None = None) -> dict[str, Any]:
    from ..runtime.resolved import resolve_precision
    from .host import cpu_run_bytes, heap_kept_bytes
    from .arch import compile_is_modelled
    from .planner import plan
    from .strategy_plan import predict_cpu_run

    if precision is None:  # a config no run resolved (other strategies, trial shapes): 'auto' as a run would resolve it
        precision = cfg.precision if (device_type == "cuda" and cfg.precision != "auto") else resolve_precision(cfg.precision, device_type).name
    run_cfg = cfg.model_copy(update={"gpus": nproc, "precision": precision})
    host_ram = host_ram if host_ram is not None else host_ram_gib()
    if device_type == "cpu":
        from ..layout import data_parallel_size

        # The heap is kept for reuse between steps (faster) where the run fits with it, else glibc's default
        # (runtime.distributed.heap_reuse); under an explicit host-RAM budget always glibc's default
        sp, total = predict_cpu_run(run_cfg, nproc, reuse_heap=False)
        reuse = cfg.cpu_memory_budget_gb is None
        if reuse:  # the same allocations, with what the kept heap holds
            with_reuse = cpu_run_bytes(sp, nproc, reuse_heap=True)
            reuse = host_fits(with_reuse / GiB, host_ram)
            total = with_reuse if reuse else total
        micro, accum, _ = run_cfg.resolve_batch(data_parallel_size(run_cfg, nproc * cfg.nodes, cfg.strategy))
        out: dict[str, Any] = {
            "cpu_gib": _gib(total), "per_rank_gib": _gib(sp.gpu_peak), "host_ram_gib": round(host_ram, 2),
            "heap_reuse": reuse, "heap_kept_gib": _gib(nproc * heap_kept_bytes(sp.gpu_peak, reuse)),
            "precision": precision, "peak_moment": sp.peak_moment, "micro_batch": micro, "grad_accum": accum,
            "predicts": "host memory of the whole CPU run (all ranks): allocations, what the heap keeps beyond them "
                        "(heap_kept_gib) and a process baseline",
            "compile_modelled": compile_is_modelled(run_cfg),
        }
        return out | _pipeline_fields(sp)
    gpu_memory = gpu_memory if gpu_memory is not None else gpu_memory_gib(nproc)
    p = plan(run_cfg, gpu_memory_gb=gpu_memory, host_ram_gb=host_ram, strategies=(cfg.strategy,), eval_blocks=eval_blocks)
    sp = p.strategies[cfg.strategy]
    out = {
        "gpu_peak_gib": _gib(sp.gpu_peak), "cpu_gib": _gib(sp.cpu_per_node), "fits": bool(sp.fits),
        "cpu_gib_cached": None if sp.cpu_per_node_cached is None else _gib(sp.cpu_per_node_cached),
        "gpu_memory_gib": round(gpu_memory, 2), "host_ram_gib": round(host_ram, 2), "precision": precision,
        "micro_batch": p.micro_batch, "grad_accum": p.grad_accum, "max_micro_batch": sp.max_micro_batch,
        "need_gib": _gib(sp.gpu_peak * RESERVED_OVER_ALLOCATED + CUDA_CONTEXT_BYTES),
        "peak_moment": sp.peak_moment, "why": sp.why, "predicts": "peak torch.cuda.max_memory_allocated per GPU",
        "compile_modelled": p.compile_modelled, "notes": p.notes,
    }
    if not sp.fits:
        out["advice"] = advice(run_cfg, p, gpu_memory)
    return out | _pipeline_fields(sp)


def _pipeline_fields(sp) -> dict[str, Any]:
    if not sp.stages:
        return {}
    return {"pipeline_split": [b for st in sp.stages for b in st["blocks"]],
            "stages": [{"gpu": st["gpu"], "blocks": st["blocks"], "peak_gib": _gib(st["peak"]),
                        "peak_in_flight": st["peak_in_flight"]} for st in sp.stages]}


def same_batch_micro(cfg: RunConfig, per_rank: int, upper: int, fits: Callable[[RunConfig], bool]) -> RunConfig | None:
    """``cfg`` at the largest micro batch up to ``upper`` that divides ``per_rank`` (each rank's batch, kept by the
    accumulation) and for which ``fits`` holds; None if none does. The advice's one search, for GPU and CPU runs."""
    cands = micro_candidates(cfg.model_copy(update={"global_batch": per_rank, "grad_accum": None}), 1, upper)

    def at(i: int) -> RunConfig:
        return cfg.model_copy(update={"micro_batch": cands[i], "grad_accum": per_rank // cands[i], "global_batch": None})

    i = largest_that_fits(len(cands), lambda i: fits(at(i)), start=len(cands) - 1)
    return at(i) if i >= 0 else None


def advice(cfg: RunConfig, p, gpu_memory: float) -> str:
    """What the plan says would fit instead, fastest change first: one line."""
    from .planner import plan

    sp = p.strategies[cfg.strategy]
    out = []
    per_rank = p.micro_batch * p.grad_accum
    if 0 < sp.max_micro_batch < p.micro_batch:
        # with accumulation the gradients live through forward too: the plan's max micro batch is only the upper end
        smaller = same_batch_micro(cfg, per_rank, sp.max_micro_batch, lambda c: plan(
            c, gpu_memory_gb=gpu_memory, strategies=(cfg.strategy,)).strategies[cfg.strategy].fits)
        if smaller is not None:
            out.append(f"--micro-batch {smaller.micro_batch} --grad-accum {smaller.grad_accum} (same global batch)")
    if not cfg.gradient_checkpointing:
        ck = plan(cfg.model_copy(update={"gradient_checkpointing": True}), gpu_memory_gb=gpu_memory, strategies=(cfg.strategy,))
        if ck.strategies[cfg.strategy].fits:
            out.append("--gradient-checkpointing")
    others = tuple(s for s in speed_order(p.gpus_per_node * p.nodes) if s != cfg.strategy)
    alt = plan(cfg, gpu_memory_gb=gpu_memory, strategies=others)
    fitting = [s for s in others if alt.strategies[s].fits]
    if fitting:
        out.append(f"--strategy {fitting[0]}")
    return "; or ".join(out) if out else "nothing the plan knows fits: more GPUs, a shorter --seq-len, or a smaller model"


def host_available_gib() -> float:
    """Host RAM a run may use on this node: what the OS has available plus what this process already
    holds (the prediction counts this process's baseline itself)."""
    return (psutil.virtual_memory().available + psutil.Process().memory_info().rss) / GiB


def check_host_ram(cfg: RunConfig, record: dict[str, Any], device_type: str, nproc: int, available_gib: float | None = None) -> None:
    """UserError, in one line with what would fit, when the plan's host-RAM prediction (``record['cpu_gib']``,
    per node) exceeds what this node has. Offload runs that do not fit are killed by the OOM killer minutes
    in, with no message; this says so before anything starts (``--force`` skips it)."""
    need = record.get("cpu_gib")
    if need is None:
        return
    avail = available_gib if available_gib is not None else host_available_gib()
    if host_fits(need, avail):
        return
    fixes = _host_fixes(cfg, record, device_type, nproc, avail)
    raise UserError(
        f"the plan predicts {cfg.strategy} needs {need:.1f} GiB of host RAM on this node (+{HOST_HEADROOM - 1:.0%} for "
        f"the prediction's error) but {avail:.1f} GiB are available"
        # on a GPU the host holds the model and optimizer states, not activations; on a CPU device it holds everything
        + (" (a smaller micro batch does not lower it: host memory holds the model and optimizer states)"
           if device_type != "cpu" else ""),
        "; or ".join(fixes + ["--force to start anyway"]),
    )


def _host_need(cfg: RunConfig, device_type: str, nproc: int, gpu_memory: float | None) -> tuple[float, bool]:
    """(host GiB per node, fits the GPU) of ``cfg``."""
    if device_type == "cpu":
        from .strategy_plan import predict_cpu_run

        return predict_cpu_run(cfg, nproc, reuse_heap=False)[1] / GiB, True  # what the run falls back to when tight
    from .planner import plan

    sp = plan(cfg, gpu_memory_gb=gpu_memory, strategies=(cfg.strategy,)).strategies[cfg.strategy]
    return sp.cpu_per_node / GiB, sp.fits


def _host_fixes(cfg: RunConfig, record: dict[str, Any], device_type: str, nproc: int, avail: float) -> list[str]:
    """What the plan says fits this node's host RAM instead: unpinned buffers, then the fastest other strategy."""
    run_cfg = cfg.model_copy(update={"gpus": nproc, "precision": record.get("precision") or cfg.precision})
    gpu_memory = record.get("gpu_memory_gib")
    out, forced = [], []
    if device_type == "cpu":  # the activations are in host memory too: a smaller micro batch, the same global batch
        m = _cpu_micro_that_fits(run_cfg, record, nproc, avail)
        if m:
            out.append(m)
    if cfg.strategy_options.pin_memory and device_type == "cuda":
        unpinned = run_cfg.model_copy(update={"strategy_options": cfg.strategy_options.model_copy(update={"pin_memory": False})})
        need, _ = _host_need(unpinned, device_type, nproc, gpu_memory)
        if need < record["cpu_gib"] and host_fits(need, avail):
            out.append(f"--no-pin-memory ({need:.1f} GiB: the pinned allocator rounds each buffer up to a power of two)")
        elif need < min(record["cpu_gib"], avail):  # bloom-7b1 zero2_offload, 125.9 GiB host: 122.35 planned, 122.5 measured
            forced.append(f"--no-pin-memory with --force ({need:.1f} GiB: under the {avail:.1f} available but inside the "
                          f"plan's {HOST_HEADROOM - 1:.0%} margin; pageable copies are slower)")
    for s in speed_order(nproc * cfg.nodes if device_type == "cuda" else 1):
        if s == cfg.strategy or (device_type == "cpu" and spec(s).offload_params == "nvme"):
            continue
        try:
            need, gpu_fits = _host_need(run_cfg.model_copy(update={"strategy": s}), device_type, nproc, gpu_memory)
        except UserError:
            continue
        if gpu_fits and host_fits(need, avail):
            out.append(f"--strategy {s} ({need:.1f} GiB)")
            break
    if not out:
        out.append("a smaller model, or a node with more RAM")
    return out + forced


def _cpu_micro_that_fits(run_cfg: RunConfig, record: dict[str, Any], nproc: int, avail: float) -> str | None:
    """The largest micro batch, with the accumulation that keeps each rank's batch, whose CPU run fits ``avail``; with
    --gradient-checkpointing where none fits without it."""
    micro, accum = record.get("micro_batch"), record.get("grad_accum")
    if not micro or not accum:
        return None
    for ckpt in sorted({run_cfg.gradient_checkpointing, True}):
        added = ckpt and not run_cfg.gradient_checkpointing  # checkpointing alone, at this micro batch, may be the fix
        base = run_cfg.model_copy(update={"gradient_checkpointing": ckpt})
        smaller = same_batch_micro(base, micro * accum, micro if added else micro - 1,
                                   lambda c: host_fits(_host_need(c, "cpu", nproc, None)[0], avail))
        if smaller is not None:
            flags = f"--micro-batch {smaller.micro_batch} --grad-accum {smaller.grad_accum}" if smaller.micro_batch != micro else ""
            if added:
                flags = f"{flags} --gradient-checkpointing".strip()
            return f"{flags} (same global batch; {_host_need(smaller, 'cpu', nproc, None)[0]:.1f} GiB)"
    return None


def with_eval_split(record: dict[str, Any], cfg: RunConfig, nproc: int, eval_blocks: int) -> dict[str, Any]:
    """The record re-planned with the eval split's size, once the worker has read the data. The launcher plans before
    that, with a full eval batch on every rank; an eval split smaller than that (the offline corpus at seq 1024: 6 blocks)
    makes the eval forward's logits smaller (strategy_plan.eval_batch_per_rank), and that forward can be the run's peak
    (bloom-7b1 zero3_offload on one GPU: 21.06 GiB planned with a full eval batch of 8, 16.28 with the 6 blocks).
    Unchanged where the eval batch is full anyway, on CPU runs, and where the plan failed; never raises."""
    if record.get("device") != "cuda" or record.get("gpu_peak_gib") is None or record.get("error"):
        return record
    try:
        from ..layout import data_parallel_size
        from .strategy_plan import eval_batch_per_rank

        run_cfg = cfg.model_copy(update={"gpus": nproc, "micro_batch": record["micro_batch"], "grad_accum": record["grad_accum"],
                                         "global_batch": None})
        dp = data_parallel_size(run_cfg, nproc * cfg.nodes, cfg.strategy)
        args = (run_cfg, cfg.strategy, record["micro_batch"], record["grad_accum"], dp)
        if eval_batch_per_rank(*args, eval_blocks) >= eval_batch_per_rank(*args, None):
            return record
        new = predict_run(run_cfg, "cuda", nproc, gpu_memory=record["gpu_memory_gib"], host_ram=record["host_ram_gib"],
                          eval_blocks=eval_blocks)
    except Exception:  # noqa: BLE001 - the launcher's record stands
        return record
    if new.get("error") or new.get("gpu_peak_gib") is None:
        return record
    return {**record, **{k: new[k] for k in ("gpu_peak_gib", "need_gib", "fits", "peak_moment") if k in new},
            "eval_blocks": eval_blocks}


def warning_line(record: dict[str, Any]) -> str | None:
    """One line for a GPU run predicted not to fit, else None."""
    if record.get("fits") is not False:
        return None
    compiled = " (eager estimate: --compile is not modelled and usually needs less)" if record.get("compile_modelled") is False else ""
    return (f"warning: the plan predicts {record['strategy']} will not fit: {record['need_gib']:.1f} GiB per GPU "
            f"(peak {record['gpu_peak_gib']:.1f} GiB allocated + CUDA context + fragmentation allowance) on "
            f"{record['gpu_memory_gib']:.1f} GiB GPUs{compiled}; fits instead: {record.get('advice', '-')}")


def heap_line(cfg: RunConfig, record: dict[str, Any]) -> str | None:
    """A CPU run that fits this node only if freed memory goes back to the system between steps says so: its steps are
    slower than with the heap kept (runtime.distributed.heap_reuse)."""
    if record.get("heap_reuse") is not False or cfg.cpu_memory_budget_gb is not None:
        return None
    return (f"host RAM is tight for this run ({record['cpu_gib']:.1f} GiB planned of {record['host_ram_gib']:.1f}): freed "
            "memory goes back to the system between steps, which makes CPU steps slower than with it kept (14-28% measured)")


def plan_for_run(run: ResolvedRun, nproc: int, auto=None, log=None) -> dict[str, Any]:
    """What the launcher does before spawning: predict the resolved run on ``nproc`` ranks per node, warn on a GPU when
    it does not fit, return the record."""
    cfg, device_type = run.cfg, run.device_type
    record = predict_run(cfg, device_type, nproc, precision=run.precision.name)
    if auto is not None:
        record["micro_batch_auto"] = auto.to_dict()
    line = warning_line(record) if device_type == "cuda" else heap_line(cfg, record)
    if line:
        (log or messages.info)(line)
    return record


def write_record(record: dict[str, Any], path: Path) -> Path:
    return write_text_atomic(path, json.dumps(record))


def read_record(path: str | Path) -> dict[str, Any] | None:
    """The record ``write_record`` left; None when it is not whole (the run then records no plan)."""
    return read_json(path)
