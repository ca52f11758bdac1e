"""`--micro-batch auto`: the largest micro batch that really runs, from the plan and short trial runs.

On a GPU
    The plan's largest micro batch predicted to fit is where the search starts. Each trial is a fresh
    `shardlab train` process on the same config for ``TRIAL_STEPS`` optimizer steps, into a temporary
    directory, with no checkpoint, no export and one eval batch: a fresh process because DeepSpeed's
    engine and the CUDA caching allocator keep state that would distort the next trial (and HF
    Trainer refuses auto_find_batch_size with DeepSpeed for that reason). A trial that runs out of GPU
    memory exits with code 3. From the start the search steps up while trials run and down while they
    run out of memory, doubling the step, then bisects: it ends at a micro batch m that ran, with the
    next allowed value above m out of memory (or m is the largest allowed).
On a CPU
    There is no memory limit to find: the kernel swaps or kills instead of raising, and on a shared
    machine a trial must not try. ``auto`` is the largest micro batch whose *predicted* host memory
    (planner with CPU activations) fits the budget ``cpu_memory_budget_gb`` (default: half of the RAM
    available now), capped at ``CPU_MAX_MICRO`` (once the cores are busy a larger micro batch only makes
    each step longer). One trial confirms that it runs and that its measured RSS stays within the
    budget; if not, the search steps down as on a GPU (never up).
The batch triple
    With a global batch given, the micro batches tried are the divisors of global / data-parallel size
    and ``grad_accum`` follows (the global batch is kept); with ``grad_accum`` given it is kept; else the
    accumulation is 1. Giving both ``grad_accum`` and ``global_batch`` leaves nothing to choose: an error.

Library use (``shardlab bench`` can call it per cell): ``cfg, result = resolve_auto_micro_batch(cfg)``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from .. import messages
from ..config import RunConfig, dump_config
from ..errors import OutOfMemory, UserError
from ..runtime.procgroup import run_group
from ..measure.summary import RunSummary
from .microbatch import CPU_MAX_MICRO, MAX_MICRO, check_auto_batch, largest_that_fits, micro_candidates, with_micro_batch
from ..strategies import strategy_class

# Function-local imports below are lazy on purpose: runtime.distributed and micro_search.py import torch (and the planner
# transformers when it reads a model), which this module does not need until `auto` is resolved.

TRIAL_STEPS = 2  # the first optimizer step allocates the optimizer states; the second runs with them
TRIAL_TIMEOUT_S = 900  # two steps; a trial that hangs (a rank died in a collective) is killed with its workers
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


# ---- the batch triple ----------------------------------------------------------------------------------


def check_auto(cfg: RunConfig, dp_world: int) -> None:
    """What `auto` cannot work with, as one-line errors (called by preflight before anything runs)."""
    check_auto_batch(cfg, dp_world)
    if cfg.nodes > 1:
        raise UserError("--micro-batch auto runs its trials on one node; this job has several",
                        "find the micro batch once on one node with the same GPUs per node, then pass --micro-batch N")
    from ..runtime.distributed import in_launched_job

    if in_launched_job():
        raise UserError("--micro-batch auto needs shardlab's own launcher (it starts trial runs before the job), "
                        "not torchrun/srun", "run `shardlab train --micro-batch auto` once without them, then pass --micro-batch N")


# ---- one trial --------------------------------------------------------------------------------------------


@dataclass
class Trial:
    micro: int
    ok: bool
    oom: bool = False
    peak_gib: float | None = None  # measured: peak allocated per GPU, or on CPU the largest rank's RSS x ranks
    seconds: float = 0.0
    message: str = ""

    @property
    def result(self) -> str:
        return "ran" if self.ok else ("out of memory" if self.oom else "failed")


def trial_config(cfg: RunConfig, micro: int, out_dir: Path, steps: int = TRIAL_STEPS) -> RunConfig:
    """The run itself, shortened: ``steps`` optimizer steps, one eval batch, no checkpoint, export or loggers."""
    dp_eval = max(1, micro)  # one eval batch per rank is enough to exercise eval memory (smaller than training's)
    dataset = cfg.dataset.model_copy(update={"eval_samples": min(cfg.dataset.eval_samples or dp_eval, dp_eval)})
    curriculum = None
    if cfg.curriculum:
        curriculum = [st.model_copy(update={"dataset": st.dataset.model_copy(update={"eval_samples": dp_eval})}) for st in cfg.curriculum]
    return with_micro_batch(cfg, micro).model_copy(update={
        "max_steps": steps, "epochs": None, "export": False, "save_every": None, "eval_every": None, "resume": None,
        "tensorboard": False, "wandb": False, "log_every": steps, "output_dir": str(out_dir), "dataset": dataset,
        "curriculum": curriculum, "save_best": False, "early_stopping_patience": None, "samples": False,
    })


def subprocess_trial(cfg: RunConfig, micro: int, device_type: str, nproc: int, workdir: Path,
                     steps: int = TRIAL_STEPS, timeout: float = TRIAL_TIMEOUT_S) -> Trial:
    """Run ``shardlab train`` on the shortened config in a fresh process; classify how it ended.

    Measured peak: the run's own peak allocated GPU memory (summary.json) on a GPU; on a CPU the peak
    resident set of the process tree as the kernel reports it when the process is reaped (wait4:
    the largest of the launcher and its workers) times the ranks."""
    out = workdir / f"micro-{micro}"
    cfg_file = workdir / f"micro-{micro}.yaml"
    cfg_file.write_text(dump_config(trial_config(cfg, micro, out, steps), given_only=True))
    log_out, log_err = workdir / f"micro-{micro}.out", workdir / f"micro-{micro}.err"
    t0 = time.perf_counter()
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        # SIGKILL at the timeout (grace 0), its spawned workers too; wait4 gives this child's peak RSS
        run = run_group([sys.executable, "-m", "shardlab", "train", "--config", str(cfg_file)], stdout=fo, stderr=fe,
                        env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=timeout)
    seconds = time.perf_counter() - t0
    stderr = log_err.read_text()
    if seconds >= timeout:
        return Trial(micro, ok=False, seconds=seconds, message=f"the trial did not finish in {timeout:.0f} s")
    if run.code == 0:
        if device_type == "cuda":
            peak = RunSummary.read(out).gpu_mem_peak_gib
        else:
            peak = run.usage.ru_maxrss * 1024 / 2**30 * nproc  # ru_maxrss is in KiB on Linux
        return Trial(micro, ok=True, peak_gib=peak, seconds=seconds)
    err = [line for line in stderr.splitlines() if line.strip()]
    last = next((line for line in reversed(err) if "error" in line.lower()), err[-1] if err else "")
    oom = run.code == OutOfMemory.exit_code or any(m.lower() in stderr.lower() for m in OOM_MARKERS)
    return Trial(micro, ok=False, oom=oom, seconds=seconds, message=last.strip()[-400:])


# ---- the search -------------------------------------------------------------------------------------------


def search_micro_batch(start: int, candidates: Sequence[int], trial: Callable[[int], Trial], *,
                       step_up: bool = True) -> tuple[int, list[Trial]]:
    """The largest candidate that runs, searched from ``start`` (the plan's value).

    Up from a run (doubling the step, at most to the largest candidate, only if ``step_up``), down from
    an out-of-memory (doubling), then bisection between the largest that ran and the smallest that did
    not. Trials at the same value are not repeated. A failure that is not about memory stops the
    search with the trial's error when nothing has run yet (the real run would fail the same way);
    above a value that ran it only bounds the search.
    """
    cands = sorted(set(int(c) for c in candidates))
    if not cands:
        raise UserError("no micro batch to try", "check --global-batch against the number of GPUs")
    tried: dict[int, Trial] = {}

    def runs(i: int) -> bool:
        if i not in tried:
            t = trial(cands[i])
            tried[i] = t
            if not t.ok and not t.oom and not any(x.ok for x in tried.values()):
                raise UserError(f"the trial run at micro batch {cands[i]} failed: {t.message or 'no error message'}",
                                "fix that error (it is not about memory), or give --micro-batch N")
        return tried[i].ok

    i = max([j for j, c in enumerate(cands) if c <= start], default=0)
    lo = largest_that_fits(len(cands) if step_up else i + 1, runs, i)  # without step_up nothing above the start
    if lo < 0:
        first = tried[0]
        raise UserError(
            f"even micro batch {cands[0]} does not fit ({first.message or first.result})",
            "use --gradient-checkpointing, a strategy that shards more (zero3, fsdp, an offload) or more GPUs",
        )
    return cands[lo], list(tried.values())


# ---- resolving `auto` for a run ----------------------------------------------------------------------------


@dataclass
class AutoBatchResult:
    chosen: int
    grad_accum: int
    global_batch: int
    plan_start: int
    device: str
    budget_gib: float | None = None
    plan_note: str = ""
    trials: list[Trial] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["trials"] = [{**asdict(t), "result": t.result} for t in self.trials]
        return d

    def line(self) -> str:
        tried = ", ".join(f"{t.micro} {t.result}" + (f" (peak {t.peak_gib:.2f} GiB)" if t.peak_gib is not None else "")
                          for t in self.trials)
        return (f"--micro-batch auto: {self.chosen} (plan: {self.plan_start}, {self.plan_note}; trials: {tried}) "
                f"-> micro {self.chosen} x accum {self.grad_accum} = global batch {self.global_batch}")


def cpu_budget_bytes(cfg: RunConfig) -> float:
    if cfg.cpu_memory_budget_gb is not None:
        return cfg.cpu_memory_budget_gb * 2**30

    return psutil.virtual_memory().available / 2


def resolve_auto_micro_batch(cfg: RunConfig, device_type: str | None = None, nproc: int | None = None, *,
                             trial: Callable[[int], Trial] | None = None, log: Callable[[str], None] | None = None,
                             workdir: str | Path | None = None) -> tuple[RunConfig, AutoBatchResult]:
    """Replace ``micro_batch: auto`` by the largest micro batch that runs (module docstring). Returns the
    config with the number filled in and what was tried. ``trial`` replaces the subprocess (tests)."""
    from ..runtime.distributed import pick_device_type, processes_per_node

    if cfg.micro_batch != "auto":
        raise ValueError("resolve_auto_micro_batch needs micro_batch 'auto'")
    device_type = device_type or pick_device_type(cfg.device)
    nproc = nproc or processes_per_node(cfg, device_type)
    world = nproc * cfg.nodes
    dp = strategy_class(cfg.strategy).data_parallel_size(cfg, world)
    check_auto(cfg, dp)
    log = log or messages.info
    budget = cpu_budget_bytes(cfg) if device_type == "cpu" else None
    start, note = plan_start(cfg, device_type, nproc, dp, budget)
    upper = MAX_MICRO if device_type == "cuda" else max(1, min(start, CPU_MAX_MICRO))
    candidates = micro_candidates(cfg, dp, upper)
    log(f"--micro-batch auto: the plan says {start} ({note}); confirming with {TRIAL_STEPS}-step trial runs, each a fresh process")
    with tempfile.TemporaryDirectory(prefix="shardlab-autobatch-", dir=workdir) as tmp:
        if trial is None:
            def trial(m: int) -> Trial:
                t = subprocess_trial(cfg, m, device_type, nproc, Path(tmp))
                if device_type == "cpu" and t.ok and t.peak_gib is not None and t.peak_gib * 2**30 > budget:
                    t = Trial(m, ok=False, oom=True, peak_gib=t.peak_gib, seconds=t.seconds,
                              message=f"measured RSS {t.peak_gib:.2f} GiB over the budget {budget / 2**30:.2f} GiB")
                log(f"  trial micro {m}: {t.result}" + (f", peak {t.peak_gib:.2f} GiB" if t.peak_gib is not None else "")
                    + f" ({t.seconds:.0f} s)")
                return t
        chosen, trials = search_micro_batch(start, candidates, trial, step_up=device_type == "cuda")
    resolved = offload_accumulation(with_micro_batch(cfg, chosen), dp, log)
    micro, accum, glob = resolved.resolve_batch(dp)
    result = AutoBatchResult(chosen=micro, grad_accum=accum, global_batch=glob, plan_start=start, device=device_type,
                             budget_gib=None if budget is None else budget / 2**30, plan_note=note, trials=trials)
    log(result.line())
    return resolved, result


# Tokens per optimizer step that an offload run (Strategy.cpu_optimizer) aims for when --micro-batch auto chooses
# the accumulation: its CPU AdamW step costs the same however many tokens the step has (bloom-7b1: seconds), so
# forward/backward must be long enough to hide it. 64 sequences of 1024 tokens, the global batch, makes
# bloom-3b/7b1's forward+backward several times longer than the CPU step on a 16-core host.
OFFLOAD_TOKENS_PER_STEP = 64 * 1024


def offload_accumulation(cfg: RunConfig, dp: int, log: Callable[[str], None]) -> RunConfig:
    """With neither --grad-accum nor --global-batch given, an offload run accumulates up to OFFLOAD_TOKENS_PER_STEP."""
    if cfg.grad_accum is not None or cfg.global_batch is not None or not strategy_class(cfg.strategy).cpu_optimizer(cfg):
        return cfg
    per_micro = cfg.micro_batch * cfg.seq_len * dp
    accum = max(1, -(-OFFLOAD_TOKENS_PER_STEP // per_micro))
    log(f"offload: accumulating {accum} micro-batches per step ({accum * per_micro:,} tokens) so the CPU optimizer step is "
        f"amortised (set --grad-accum or --global-batch to choose)")
    return cfg.model_copy(update={"grad_accum": accum})


def plan_start(cfg: RunConfig, device_type: str, nproc: int, dp: int, cpu_budget: float | None) -> tuple[int, str]:
    """The plan's largest micro batch predicted to fit (GPU memory, or the CPU budget); 1 when it cannot say."""
    from .micro_search import auto_micro_batch

    try:
        micro, why = auto_micro_batch(cfg, device_type=device_type, nproc=nproc, dp=dp, cpu_budget=cpu_budget)
    except UserError as err:
        return 1, f"no plan: {err.message}"
    return max(1, micro), why
