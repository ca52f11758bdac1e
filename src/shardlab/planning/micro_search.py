"""The plan's micro-batch searches over predictions, each through microbatch.largest_that_fits: a strategy's largest micro
batch that fits the budget (the plan's 'max micro'), `--micro-batch auto` as the plan sees it (each strategy's own, and
the start that autobatch.py's trial runs confirm), and the optimizer options beyond exact AdamW when nothing fits.
"""

from __future__ import annotations

from typing import Callable

from ..config import RunConfig
from ..errors import UserError
from ..specs.registry import find
from ..runtime.resolved import resolve_precision
from . import arch as architecture
from .budget import Budget, detect_gpu_memory, usable
from .host import cpu_run_bytes
from .memory import RESERVED_OVER_ALLOCATED, Arch, GiB, StrategyPlan
from .microbatch import CPU_MAX_MICRO, MAX_MICRO, largest_that_fits, micro_candidates, with_micro_batch
from .strategy_plan import dp_size, strategy_plan


def own_auto_micro(s: str, arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, d: int, budget: Budget,
                   max_search: int, eval_blocks: int | None) -> tuple[int, int]:
    """(micro, accum) for strategy ``s`` under `--micro-batch auto`: its largest micro batch that fits GPU and host memory
    (1 when none does, so the table still says why not). One micro batch for every strategy would plan them all at the
    configured strategy's: for bloom-7b1 on one 80 GB GPU and a global batch of 32, dp's (none fits, so 1 x accum 32),
    where fsdp_offload fits all 32 without accumulation (14.4% MFU measured at 32 x 1, 10.8% at 8 x 4) and, with Liger's
    loss, ao_offload does too (24.3%; benchmarks/results/*-h100-big-model calls 5-7)."""
    dp = dp_size(s, cfg, d)
    m, _ = auto_micro(arch, cfg, s, precision, gpus_per_node, dp, lambda sp: budget.fits(sp)[0], "cuda", max_search, eval_blocks)
    s_micro, s_accum, _ = with_micro_batch(cfg, max(1, m)).resolve_batch(dp)
    return s_micro, s_accum


# The optimizer options tried, in order, when nothing fits with exact AdamW: each drops more exactness for memory
# (8-bit moments and the step in backward: 16 -> 6 B/param for dp; then bf16 weights: -> 4 B/param).
BEYOND_EXACT = (
    {"optimizer": "adamw8bit", "optimizer_in_backward": True},
    {"optimizer": "adamw8bit", "optimizer_in_backward": True, "master_weights": "bf16"},
)


def beyond_exact(arch: Arch, cfg: RunConfig, precision: str, gpus_per_node: int, budget: Budget,
                 max_search: int) -> tuple[str, str, StrategyPlan, RunConfig] | None:
    """(strategy, flags, prediction, the run's config with them) of the first BEYOND_EXACT option that fits, on one GPU, for
    a run that asked for exact AdamW. The step in backward cannot accumulate, so the micro batch is the whole per-GPU
    batch: the given global batch when it fits, else the largest that does."""
    if gpus_per_node * cfg.nodes != 1 or cfg.optimizer != "adamw" or cfg.optimizer_in_backward or precision != "bf16":
        return None
    # the first strategy that takes every option below (dp: on one rank, DDP's own reduce is no obstacle)
    strategy = find(supports_8bit=True, supports_in_backward=True, supports_bf16_master=True)
    micro, accum, _ = cfg.resolve_batch(1)
    for option in BEYOND_EXACT:
        c = cfg.model_copy(update={**option, "max_grad_norm": None, "micro_batch": 1, "grad_accum": 1, "global_batch": None})
        largest = largest_micro(strategy, arch, c, 1, precision, gpus_per_node, budget, min(max_search, micro * accum))
        if largest < 1:
            continue
        sp = strategy_plan(strategy, arch, c, largest, 1, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing)
        sp.fits, sp.why = budget.fits(sp)
        if not sp.fits:
            continue
        sp.headroom = usable(budget.gpu) - sp.gpu_peak * RESERVED_OVER_ALLOCATED
        sp.max_micro_batch = largest
        flags = " ".join([f"--strategy {strategy} --optimizer adamw8bit --optimizer-in-backward"]
                         + (["--master-weights bf16"] if c.master_weights == "bf16" else [])
                         + [f"--micro-batch {largest} --grad-accum 1 --set max_grad_norm=null"])
        return strategy, flags, sp, c.model_copy(update={"micro_batch": largest})
    return None


def auto_micro(arch: Arch, cfg: RunConfig, strategy: str, precision: str, gpus_per_node: int, dp: int,
               fits: Callable[[StrategyPlan], bool], device: str, upper: int, eval_blocks: int | None = None) -> tuple[int, str]:
    """Largest allowed micro batch (microbatch.micro_candidates: divisors of a given global batch) whose
    prediction ``fits``, the accumulation following the batch triple; 0 when even the smallest does not."""
    cands = micro_candidates(cfg, dp, upper)

    def ok(i: int) -> bool:
        c = with_micro_batch(cfg, cands[i])
        m, a, _ = c.resolve_batch(dp)
        return fits(strategy_plan(strategy, arch, c, m, a, precision, gpus_per_node, cfg.nodes, cfg.gradient_checkpointing, device,
                                  eval_blocks=eval_blocks))

    if cfg.global_batch is not None:
        # The accumulation falls as the micro batch grows, and at 1 the accumulation buffers go (dp's gradients at the
        # start of backward, ao_offload's fp32 gradients: 26 GiB for bloom-7b1), so the peak is not monotone in the
        # micro batch: the whole per-rank batch can fit where half of it with accumulation does not. Few candidates
        # (the divisors): try them from the largest down.
        lo = next((i for i in reversed(range(len(cands))) if ok(i)), -1)
    else:
        lo = largest_that_fits(len(cands), ok)  # fixed accumulation: predicted peaks grow with the micro batch
    if lo < 0:
        return 0, f"not even micro batch 1 is predicted to fit {strategy}"
    return cands[lo], f"the largest predicted to fit {strategy}"


def auto_micro_batch(cfg: RunConfig, *, device_type: str, nproc: int, dp: int, cpu_budget: float | None = None,
                     gpu_memory_gb: float | None = None) -> tuple[int, str]:
    """Where `--micro-batch auto` starts: the largest micro batch predicted to fit ``cfg.strategy``.

    GPU: the detected (or given) GPU memory, with the CUDA context and fragmentation allowance of
    ``fits``. CPU: the whole run's predicted host memory (``cpu_run_bytes``) within ``cpu_budget`` bytes,
    at most microbatch.CPU_MAX_MICRO."""
    arch = architecture.read_arch(cfg)
    run_cfg = cfg.model_copy(update={"gpus": nproc})
    if device_type == "cpu":
        precision = resolve_precision(cfg.precision, "cpu").name
        if cpu_budget is None:
            raise UserError("a CPU plan needs a host-RAM budget", "set cpu_memory_budget_gb")
        micro, _ = auto_micro(arch, run_cfg, cfg.strategy, precision, nproc, dp,
                              lambda sp: cpu_run_bytes(sp, nproc, reuse_heap=False) <= cpu_budget, "cpu", CPU_MAX_MICRO)
        return micro, f"the largest predicted within the {cpu_budget / GiB:.1f} GiB host-RAM budget, at most {CPU_MAX_MICRO} on CPU"
    precision = cfg.precision if cfg.precision != "auto" else "bf16"
    if gpu_memory_gb is not None:
        gpu_memory = gpu_memory_gb * GiB
    else:
        gpu_memory = detect_gpu_memory("cuda")
        if gpu_memory is None:
            raise UserError("no CUDA GPU visible to read its memory from", "pass --device cpu")
    micro, _ = auto_micro(arch, run_cfg, cfg.strategy, precision, nproc, dp, Budget(gpu_memory).gpu_fits, "cuda", MAX_MICRO)
    return micro, f"the largest predicted to fit {cfg.strategy} in {gpu_memory / GiB:.1f} GiB per GPU"


def largest_micro(strategy: str, arch: Arch, cfg: RunConfig, accum: int, precision: str, gpus_per_node: int,
                  budget: Budget, max_search: int) -> int:
    """Largest micro batch up to ``max_search`` whose predicted GPU need fits (peak is increasing in the micro batch): 0 if none."""
    def ok(i: int) -> bool:  # index i: micro batch i + 1
        return budget.gpu_fits(strategy_plan(strategy, arch, cfg, i + 1, accum, precision, gpus_per_node, cfg.nodes,
                                             cfg.gradient_checkpointing))

    return largest_that_fits(max_search, ok) + 1
