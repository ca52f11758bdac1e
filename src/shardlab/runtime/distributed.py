"""Who am I in the job: rank, world size, device; process-group setup and teardown.

Works in three situations without the user choosing anything: a single process with
no launcher (world 1, no process group needed by DDP-free strategies but created anyway so
every engine sees the same world), a worker spawned by shardlab's own launcher or by
torchrun / deepspeed (RANK, WORLD_SIZE, LOCAL_RANK set), and a SLURM task started by srun
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID mapped onto the torch variables).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from ..errors import UserError
from .process import HEAP_TRIM_BYTES, NODE_AGENT_ENV, in_launched_job  # noqa: F401 - owned by the torch-free process.py, used here and by others

if TYPE_CHECKING:
    from ..config import RunConfig


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()


def launched_world_size() -> int | None:
    """WORLD_SIZE of an already-launched job (torchrun/deepspeed, or srun's SLURM_NTASKS), else None."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if in_launched_job():
        return int(os.environ["SLURM_NTASKS"])
    return None


def _adopt_slurm_env() -> None:
    """Map srun's variables onto torch's, so `srun shardlab train` joins instead of relaunching."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or os.environ.get(NODE_AGENT_ENV):
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_ADDR", first_slurm_host() or "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def first_slurm_host() -> str | None:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    # "gpu[01-04],cpu1" -> "gpu01"; scontrol would do it, but it may not be on PATH inside containers.
    first = nodelist.split(",")[0]
    if "[" in first:
        prefix, rest = first.split("[", 1)
        first = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return first


def pick_device_type(requested: str) -> str:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' requested but no CUDA GPU is visible", "run on a GPU node or use --device cpu")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def processes_per_node(cfg: RunConfig, device_type: str) -> int:
    """Ranks this node starts: the visible GPUs (or --gpus of them); on a CPU, --gpus worker processes."""
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if cfg.gpus is None:
            return visible
        if cfg.gpus > visible:
            raise UserError(f"--gpus {cfg.gpus} but only {visible} GPU(s) are visible on this node", f"use --gpus {visible} or fewer (check CUDA_VISIBLE_DEVICES)")
        return cfg.gpus
    # On CPU, --gpus N means N worker processes (gloo), which is how shardlab tests multi-rank runs (RunConfig refuses 0).
    return cfg.gpus or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str, timeout_s: float = 1800) -> DistEnv:
    """Create the process group (gloo on CPU, nccl on GPU) and return this process's place in it."""
    _adopt_slurm_env()
    if "RANK" not in os.environ:  # plain `python`/`shardlab train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        # `srun --gpus-per-task 1` shows each task only its own GPU: index modulo what is visible.
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        # The timeout bounds how long a collective waits for a rank that hangs (a dead one usually
        # breaks the connection at once); NCCL's watchdog then aborts the process.
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def bind_threads_to_rank_cores(local_rank: int, local_world: int) -> list[int]:
    """Give this rank its own contiguous share of the cores it may run on, and as many torch/OpenMP threads.

    What DeepSpeed's launcher does with `--bind_cores_to_rank` (numactl -C + OMP_NUM_THREADS), for the
    workers shardlab spawns itself: a CPU optimizer (DeepSpeed's CPU-Adam, torch's fused CPU AdamW) is
    memory-bound and OpenMP-parallel, and ranks whose threads share cores slow each other down. Returns
    the cores bound (none when there are fewer cores than ranks: nothing to split).
    """
    mine = rank_share(sorted(os.sched_getaffinity(0)), local_rank, local_world)
    if not mine:
        return []
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # read by OpenMP runtimes (DeepSpeed's op) loaded after this
    torch.set_num_threads(len(mine))
    return mine


def parse_cpu_list(text: str) -> list[int]:
    """Linux's CPU list format ("0-3,16,18-19") as the CPUs it names."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus += range(int(first), int(last or first) + 1)
    return cpus


def core_siblings(cpu: int) -> tuple[int, ...]:
    """The logical CPUs that share ``cpu``'s physical core (SMT siblings, from sysfs); ``cpu`` alone where unknown."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return tuple(sorted(parse_cpu_list(f.read()))) or (cpu,)
    except (OSError, ValueError):
        return (cpu,)


def physical_cores(cores: list[int]) -> list[list[int]]:
    """``cores`` grouped by physical core, each group sorted, the groups in order of their first CPU."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in cores:
        groups.setdefault(core_siblings(cpu), []).append(cpu)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def rank_share(cores: list[int], local_rank: int, local_world: int) -> list[int]:
    """Local rank `local_rank`'s share of `cores` among `local_world` ranks: whole physical cores, contiguous, sorted;
    [] when there are fewer CPUs than ranks. By physical core because Linux numbers SMT siblings apart (0 and 16 on a
    16-core host with SMT): halves of the logical list would give two ranks the two threads of every core, and their
    pinned training threads (the last CPU of each share) one core. Fewer cores than ranks: split by logical CPU."""
    units = physical_cores(cores)
    if len(units) < local_world:
        units = [[cpu] for cpu in sorted(cores)]
    per_rank = len(units) // max(1, local_world)
    return sorted(cpu for unit in units[local_rank * per_rank:(local_rank + 1) * per_rank] for cpu in unit)


# glibc's mallopt parameters (malloc.h) and their defaults.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


def heap_reuse(cfg: RunConfig, device_type: str, record: dict | None) -> bool:
    """Whether a run keeps freed heap memory for the next step (reuse_freed_heap): a CPU run without
    an explicit host-RAM budget (``cpu_memory_budget_gb``, which sizes runs by glibc's default), unless the launcher's
    plan (``record``, run_plan.predict_run) found that only glibc's default fits this node. A rank started without the
    record (torchrun's other ranks) keeps the heap."""
    if device_type != "cpu" or cfg.cpu_memory_budget_gb is not None:
        return False
    return bool((record or {}).get("heap_reuse", True))


@contextlib.contextmanager
def reuse_freed_heap(enabled: bool = True):
    """While a CPU-device run trains, keep freed large buffers in the heap for the next step.

    glibc serves every allocation above its largest mmap threshold (32 MB) with a fresh mmap and unmaps it on free, so
    each step's big tensors (tiny-gpt2's logits at micro 8 x 128: 206 MB, and as much again for their gradient) are
    page-faulted and zeroed by the kernel anew. jemalloc and tcmalloc, which PyTorch's CPU performance guide recommends,
    reuse memory the same way; this does it with the allocator every Linux has. Measured on 2 cores, gpt2 fp32
    (benchmarks/results/*-cpu-host-model): steps 12-22% shorter than with glibc's default (dp at micro 2 x 256:
    2.87 s against 3.27 s), for a resident peak 0.26-1.26 GiB higher; what the heap keeps beyond live memory is
    planning.host.heap_kept_bytes, which the plan counts. The trainer turns it on only where the plan says the run fits
    with it (``heap_reuse`` above).
    Restored afterwards, with the heap trimmed, so a notebook's process that ran `shardlab.train()` gets its memory back.
    A no-op where the C library is not glibc."""
    libc = None
    if enabled and sys.platform == "linux":
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt  # noqa: B018 - glibc's, absent from musl
        except (OSError, AttributeError):
            libc = None
    if libc is None:
        yield False
        return
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # both C ints: a larger Python int would be truncated
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_BYTES)
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)


_group_broken = False


def mark_group_broken() -> None:
    """A peer died or hung: this process's group must not be torn down (see `shutdown_distributed`)."""
    global _group_broken
    _group_broken = True


def exit_process(code: int) -> NoReturn:
    """`sys.exit(code)`, except after a peer died: then flush and `os._exit`, skipping the interpreter's teardown,
    which would destroy the broken group's backend objects (a std::terminate there aborts with SIGABRT)."""
    if _group_broken:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def shutdown_distributed() -> None:
    # Destroying a group whose peer is gone can end in std::terminate ("terminate called without an active
    # exception", SIGABRT) inside the backend's teardown; a broken group is left alone and the process exits
    # (`exit_process`).
    if _group_broken:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
