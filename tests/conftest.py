"""Shared test setup: offline hub, per-session caches, `shardlab train` as a subprocess, and the
session's registry of shared training runs.

Every training run is its own `python -m shardlab train` process, so DeepSpeed's and
torch.distributed's global state (process groups, accelerator choice, JIT ops) can never
leak from one test into the next. The process is forked from the session's zygote (zygote.py), which has
imported shardlab, torch, transformers and DeepSpeed once, instead of importing them again (~8 s of CPU a run
on 2 cores); it is the training process itself, without `shardlab train`'s supervising parent, whose own
behaviour tests/test_never_silent.py checks with real interpreters.

Two tiers (`make test` runs both in one session; `make test-fast` runs the fast one alone):
  fast  `pytest -m "not slow"`: unit tests, preflight errors, report tables from committed run
        directories, and one single-rank training each of dp, zero2 and fsdp. The whole tier must stay
        within 5 minutes on 2 CPU cores.
  slow  `pytest -m slow`: everything else.
`make test` runs on 2 pytest-xdist workers (`-n 2 --dist loadgroup`): much of the slow tier's time is spent
waiting on processes; `pytest_collection_modifyitems` below keeps a module's tests that share a module fixture on one
worker.
The rule for a new test: if it spawns more than one rank (--gpus N>1, torchrun, two nodes, a pipeline),
runs a training subprocess longer than ~10 s, runs a bench/peer/SLURM job, or trains a configuration that
no fast test already trains, mark it `@pytest.mark.slow`. Prefer an in-process unit test for an error path.

Shared runs: a test that reads a training run asks the `shared_runs` registry for it by its arguments
(`shared_runs.get(ARGS)`): the first asker trains it, every later one, in any module, reads the same run
directory. Identical configurations therefore train once per pytest run, not once per module. Nobody may
change a shared run's directory (copy it first); a run resumed into another's directory is its own entry
(`out=`). Never assert a gap that depends on the CPU (bf16 vs fp32 losses, wall-clock or memory bounds):
the suite must pass on any x86-64 machine, loaded or not.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import yaml

from zygote import ZYGOTE, run_shardlab

# A training run is seconds on CPU; this is only a guard against a hung collective.
RUN_TIMEOUT_S = 420



@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's `--dist loadgroup` (`make test` runs on 2 workers): tests that share a
    module-, class- or package-scoped fixture (a training run, a SLURM cluster, a bench that several tests read) run
    on one worker, so the fixture is built once and not once per worker. A group is a connected set: two tests that
    share any such fixture, directly or through a third test, are in the same group; a module whose fixtures form
    separate sets gives separate groups, and the workers share them out. Every other test goes to whichever worker
    is free. Cheap fixtures (a directory) are session- or function-scoped so that they join nothing. The shared runs
    need no group: the registry is shared across workers (SharedRuns). Without xdist the marks do nothing.

    tryfirst: each xdist worker turns an item's `xdist_group` mark into its node id's "@group" suffix (what the
    scheduler groups by) in its own pytest_collection_modifyitems, and that plugin is registered after this conftest,
    so pluggy would call it first: the marks added here came too late, no test was grouped, and a module fixture was
    built once on each worker (the 260 s `bench` twice)."""
    parent: dict[tuple, tuple] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    shared: dict[int, list[tuple]] = {}
    for i, item in enumerate(items):
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        keys = [(item.module.__name__, name) for name, defs in info.name2fixturedefs.items()
                if defs and defs[-1].scope in ("module", "class", "package")]
        for a, b in zip(keys, keys[1:]):
            parent[find(a)] = find(b)
        if keys:
            shared[i] = keys
    for i, keys in shared.items():
        module, name = find(keys[0])
        items[i].add_marker(pytest.mark.xdist_group(f"{module}.{name}"))


def worker_cores(cores: list[int], worker: str, workers: int) -> list[int]:
    """The cores of pytest-xdist worker ``worker`` ("gw1"): its own contiguous share of ``cores``, the last worker taking
    any remainder; [] (no confinement) when there are fewer cores than workers or the name is not an xdist worker's."""
    per = len(cores) // workers
    if per == 0 or not worker.startswith("gw") or not worker[2:].isdigit():
        return []
    i = int(worker[2:]) % workers
    return cores[i * per:] if i == workers - 1 else cores[i * per:(i + 1) * per]


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory):
    """No network, and every cache (tokenized blocks, HF datasets Arrow files) in this session's tmp dir."""
    base = tmp_path_factory.mktemp("env")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("SHARDLAB_CACHE", str(base / "shardlab-cache"))
        mp.setenv("HF_DATASETS_CACHE", str(base / "hf-datasets"))
        if os.environ.get("PYTEST_XDIST_WORKER"):
            # The GGUF parts (SmolLM2's config, tokenizer, info and fp32 weights: 3.6 + 3.4 + 2.9 + 12.1 s of one core)
            # are built once for every xdist worker of this pytest run, not once per worker: the cache's gguf/ is a link
            # to one directory beside the workers' base temp dirs. cachedir.built_once builds each part under an flock
            # and renames it into place, so two workers asking at once build it once and never see half of it.
            gguf = base.parent.parent / "gguf"
            gguf.mkdir(exist_ok=True)
            (base / "shardlab-cache").mkdir()
            (base / "shardlab-cache" / "gguf").symlink_to(gguf, target_is_directory=True)
        # Inductor's cache: this session's. Importing torch._inductor sets the variable to the machine-wide
        # /tmp/torchinductor_<user> in this process otherwise, and every `shardlab train` started from here would
        # inherit it (and find graphs compiled by earlier sessions: cache hits where a test expects compiling).
        # One directory for every xdist worker of this pytest run (their base temp dirs are siblings): a graph the other
        # worker compiled (torchao's optimizer step, 55 s of inductor on 2 cores for tiny-gpt2) loads from the cache.
        shared = base.parent.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared / "inductor"))
        # Each xdist worker's share of the cores: torch's default (one OpenMP thread per core) in every worker put
        # 4 spinning threads on 2 cores. Two tiny-gpt2 runs side by side took 0.22 s a step at 2 threads each and
        # 0.12-0.14 s at 1 (alone: 0.077 s at 2 threads, 0.129 s at 1). The zygote and every command inherit it;
        # multi-rank runs and CPU-optimizer runs still set their own per rank (runtime/distributed.py).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        if workers > 1:
            threads = max(1, len(os.sched_getaffinity(0)) // workers)
            mp.setenv("OMP_NUM_THREADS", str(threads))
            import torch

            torch.set_num_threads(threads)
            # ...and those cores only. Runs with a CPU optimizer, and multi-rank runs, split the cores they may run on
            # among their ranks (runtime/distributed.bind_threads_to_rank_cores): unconfined, a single-rank
            # zero1_offload run took both cores with 2 OpenMP threads while the other worker's test ran on one of them,
            # and each parallel region waited for the descheduled thread: 0.75 s a step instead of 0.09 s.
            cores = worker_cores(sorted(os.sched_getaffinity(0)), os.environ.get("PYTEST_XDIST_WORKER", ""), workers)
            if cores:
                os.sched_setaffinity(0, cores)
        try:  # the in-process side (datasets reads the variable at import)
            import datasets.config

            mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(base / "hf-datasets"))
        except ImportError:  # pragma: no cover
            pass
        ZYGOTE.start()  # with this environment; it imports while the first tests run
        yield base
        ZYGOTE.stop()
        if ZYGOTE.fallbacks:  # for pytest_terminal_summary (the xdist controller's), beside the workers' base temp dirs
            root = base.parent.parent if os.environ.get("PYTEST_XDIST_WORKER") else base.parent
            name = os.environ.get("PYTEST_XDIST_WORKER", "main")
            (root / f"zygote-fallbacks-{name}.json").write_text(json.dumps(ZYGOTE.fallbacks))


def pytest_terminal_summary(terminalreporter, config):
    """How many `shardlab` commands of this run were not forked from a zygote and why (zygote.py: an environment that
    differs from the zygote's, or no zygote): each paid ~8 s of CPU for imports, so the list is where to look first when
    a tier gets slower. Tests that start real interpreters on purpose call subprocess themselves and are not counted;
    nor are a bench's cells (zygote.client: the zygote checks their environment itself)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or getattr(config, "workerinput", None) is not None:
        return
    try:
        root = factory.getbasetemp()
    except (OSError, ValueError):
        return
    reasons = [r for f in sorted(root.glob("zygote-fallbacks-*.json")) for r in json.loads(f.read_text())]
    if reasons:
        counts: dict[str, int] = {}
        for r in reasons:
            counts[r] = counts.get(r, 0) + 1
        terminalreporter.write_line(f"zygote: {len(reasons)} command(s) ran in a real interpreter instead of a fork:")
        for r, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {n} x {r}")


@pytest.fixture(autouse=True)
def functional_linear_restored():
    """Each test leaves torch.nn.functional.linear as it found it. DeepSpeed's ZeRO-3 (zero.Init, with its default
    memory_efficient_linear) replaces it with its own autograd Function for the rest of the process, "unless manually
    reset"; a later in-process test of what autograd saves then counted that Function's fp32 inputs instead of the
    linears' 16-bit casts (test_plan.py::test_autocast_casts_an_activation_once_per_projection on 2 xdist workers)."""
    import torch

    before = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = before


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves os.environ as it found it. In-process tests run shardlab code that sets variables for the
    process it expects to own (runtime/distributed.bind_cores sets OMP_NUM_THREADS), and one leaked variable made every
    later command of that pytest process differ from the zygote's environment: a real interpreter each (~8 s of
    imports), and test_harness failing when it ran after such a test (fast tier on 2 xdist workers)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="module")
def one_rank():
    """A single-rank gloo process group in this pytest process, for the in-process tests of FSDP2 and DeepSpeed
    (both need one); one per module that asks (the xdist groups keep a module's users on one worker)."""
    import torch
    import torch.distributed as dist

    from shardlab.runtime.distributed import DistEnv, free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    dist.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)


@dataclass
class TrainRun:
    """One finished `shardlab train` invocation and what it left in its run directory."""

    out: Path
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> "TrainRun":
        assert self.returncode == 0, f"shardlab train {' '.join(self.args)} exited {self.returncode}:\n{self.stderr[-8000:]}"
        return self

    @property
    def all_rows(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Training rows (one per logged step), without eval and epoch-summary rows."""
        return [r for r in self.all_rows if "loss" in r]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    @cached_property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    @cached_property
    def config(self) -> dict[str, Any]:
        return yaml.safe_load((self.out / "config.yaml").read_text())


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def shardlab_train(args: list[str], out: Path | None, timeout: float = RUN_TIMEOUT_S,
                   env_extra: dict[str, str] | None = None) -> TrainRun:
    """`python -m shardlab train ARGS --output-dir OUT` in a fresh process (forked from the session's zygote: zygote.py;
    a fresh interpreter where ``env_extra`` sets a variable that libraries read at import)."""
    full = ["train", *args] + (["--output-dir", str(out)] if out is not None else [])
    # A fresh `shardlab train`, as a user starts it: never a worker of a process group that an in-process test of
    # this pytest process set up (a module fixture's RANK/MASTER_PORT made such a run rendezvous on a taken port).
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(env_extra or {})
    proc = run_shardlab(full, env=env, timeout=timeout)
    return TrainRun(Path(out) if out is not None else Path(), args, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def train_cli():
    return shardlab_train


class SharedRuns:
    """`shardlab train` runs that tests read, one per configuration per pytest run (see the module doc), shared by
    every pytest-xdist worker: a configuration's lock file makes one process train it while any other that asks for it
    waits, and its record (exit status, output) lets every later asker, in any worker, read the same run directory."""

    def __init__(self, root: Path, train=shardlab_train):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.train = train
        self._runs: dict[tuple, TrainRun] = {}

    @staticmethod
    def _key(args: list[str], out: Path | None) -> tuple:
        return (*args, "--output-dir", str(out)) if out is not None else tuple(args)

    def _files(self, key: tuple) -> tuple[Path, Path]:
        digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]
        return self.root / f".{digest}.lock", self.root / f".{digest}.json"

    def _new_dir(self, name: str) -> Path:
        n = 0
        while True:  # mkdir is atomic: two workers naming runs alike get two directories
            out = self.root / (name if n == 0 else f"{name}-{n}")
            try:
                out.mkdir(parents=True)
                return out
            except FileExistsError:
                n += 1

    def get(self, args: list[str], name: str = "run", out: Path | None = None, prepare=None) -> TrainRun:
        """The run of `shardlab train ARGS`, trained now if no process of this pytest run has trained it yet.

        `name` names a new run directory under the registry's root (the first asker's name wins);
        `out` is an explicit directory, part of the configuration (a resume into an earlier run's directory);
        `prepare()` runs just before the training, only if this call trains (under the configuration's lock)."""
        key = self._key(args, out)
        if key in self._runs:
            return self._runs[key]
        lock, record = self._files(key)
        with open(lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if record.is_file():
                r = json.loads(record.read_text())
                run = TrainRun(Path(r["out"]), list(args), r["returncode"], r["stdout"], r["stderr"])
            else:
                if prepare is not None:
                    prepare()
                run = self.train(list(args), out if out is not None else self._new_dir(name))
                tmp = record.with_suffix(".tmp")
                tmp.write_text(json.dumps({"out": str(run.out), "returncode": run.returncode, "stdout": run.stdout,
                                           "stderr": run.stderr}))
                tmp.replace(record)
        self._runs[key] = run
        return run


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    # One root for every xdist worker of this pytest run (their base temp dirs are siblings), so they share the runs.
    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs")


def eval_loss_like_the_trainer(model, dataset, world: int) -> float:
    """Token-weighted mean loss over the blocks DistributedSampler(drop_last=False) gives `world` ranks."""
    import torch

    n = len(dataset)
    indices = list(range(n)) + list(range(n))[: math.ceil(n / world) * world - n]
    total = tokens = 0.0
    with torch.no_grad():
        for i in indices:
            batch = {k: v.unsqueeze(0) for k, v in dataset[i].items()}
            n_tok = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss.double()) * n_tok
            tokens += n_tok
    return total / tokens


@pytest.fixture(scope="session")
def trainer_eval_loss():
    """`eval_loss_like_the_trainer`: what an exported model's eval loss must reproduce."""
    return eval_loss_like_the_trainer
