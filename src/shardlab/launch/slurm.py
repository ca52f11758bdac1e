"""`shardlab slurm`: an sbatch script for a run config, with the code and config it will run snapshotted.

SLURM runs whatever is on disk when a job *starts*, which may be hours after `sbatch`: so the
shardlab package and the resolved config are copied into the run directory at submission, and
the script runs those copies. Inside the job one srun task per node runs `shardlab train`; each
starts its node's workers and they meet at the allocation's first host (from SLURM's variables:
no SSH, no hostfile). SLURM's warning signal (`--signal=USR1@SECONDS`) and its SIGTERM make every
rank finish its step and checkpoint (runtime/preemption.py); the script then requeues the job
(`--requeue`), and the requeued job resumes with `--resume auto`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig, dump_config
from ..runtime.distributed import NODE_AGENT_ENV
from ..errors import UserError
from ..runtime.preemption import REQUEUE_EXIT
from ..specs.registry import spec
from ..strategies import strategy_class

# Lazy imports below: training.models (transformers) and data.cache (the data package) load only when a job script
# needs the model's config or the cache directory.

SCRIPT_NAME = "job.sbatch"


@dataclass
class SlurmOptions:
    """What sbatch needs beyond the run config (nodes and GPUs per node come from the config)."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None  # sbatch's formats: MM, HH:MM:SS, D-HH:MM:SS
    mem: str | None = None  # per node, e.g. 64G
    cpus_per_task: int | None = None  # one task per node: the node's CPU cores for its workers
    job_name: str | None = None
    setup: list[str] = field(default_factory=list)  # shell lines before srun: module load, source venv/bin/activate
    signal_lead_s: int = 300  # SIGUSR1 this long before the time limit: time to finish a step and checkpoint
    python: str = sys.executable
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH lines, e.g. --qos=short


@dataclass
class SlurmJob:
    snapshot: Path  # run_dir/slurm/<stamp>: code/, config.yaml, job.sbatch, provenance.json, slurm-<jobid>.out
    script: Path
    command: list[str]
    job_id: str | None = None


def _check(cfg: RunConfig, opts: SlurmOptions) -> None:
    from ..training.models import build_hf_config

    if cfg.device != "cpu" and not cfg.gpus:
        raise UserError("shardlab slurm needs the number of GPUs per node", "pass --gpus N (and --nodes M)")
    if cfg.resume not in (None, "auto"):
        raise UserError("a shardlab slurm job always resumes with --resume auto (from its own output dir), so that a requeue continues", "copy the checkpoint into OUTPUT_DIR/checkpoints/ and drop --resume")
    if cfg.hostfile:
        raise UserError("--hostfile is for machines you start by hand; under SLURM the allocation gives the hosts", "drop --hostfile")
    if opts.signal_lead_s < 0:
        raise UserError("--signal-lead must be 0 or more seconds", "e.g. --signal-lead 300")
    if opts.cpus_per_task is not None and opts.cpus_per_task < 1:
        raise UserError("--cpus-per-task must be at least 1", "e.g. --cpus-per-task 16")
    world = (cfg.gpus or 1) * cfg.nodes
    cfg.resolve_batch(strategy_class(cfg.strategy).data_parallel_size(cfg, world))  # a batch that cannot split fails now, not in the queue
    build_hf_config(cfg)  # an unknown model fails now too


def cpus_per_task(cfg: RunConfig, opts: SlurmOptions) -> tuple[int, str | None]:
    """--cpus-per-task, and the line saying how it was chosen when it was not given. One task per node runs all of
    the node's workers, and SLURM's default (often 1 CPU per task) would make them share one core: at least one each."""
    if opts.cpus_per_task is not None:
        return opts.cpus_per_task, None
    workers = cfg.gpus or 1
    return workers, (f"--cpus-per-task not given: {workers} (one CPU core per worker, the least that does not make the node's "
                     f"{workers} worker(s) share SLURM's default of one); data loading and CPU offload want more: pass --cpus-per-task")


def shared_paths(cfg: RunConfig, snapshot: Path) -> list[str]:
    """What every node of the job reads or writes, so must be on a filesystem all nodes share."""
    paths = [f"{snapshot} (code and config)", f"{cfg.output_dir} (checkpoints, metrics)"]
    for what, value in (("dataset", cfg.dataset.source), ("model", cfg.model), ("tokenizer", cfg.tokenizer),
                        ("DeepSpeed JSON", cfg.deepspeed_config)):
        if value and Path(value).expanduser().exists():
            paths.append(f"{Path(value).expanduser().resolve()} ({what})")
    paths.append(f"{os.environ.get('HF_HOME', '~/.cache/huggingface')} (HF_HOME: hub models and datasets, unless local)")
    from ..data.cache import default_cache_dir  # here: it imports torch, which writing a script does not need

    paths.append(f"{default_cache_dir()} (SHARDLAB_CACHE: tokenized data; rank 0 builds it, the other ranks read it)")
    return paths


def job_config(cfg: RunConfig) -> RunConfig:
    """The config the job runs: absolute output dir (the job's cwd may differ) and resume on requeue."""
    return cfg.model_copy(update={"output_dir": str(Path(cfg.output_dir).resolve()), "resume": "auto"})


def render(cfg: RunConfig, opts: SlurmOptions, snapshot: Path) -> str:
    """The sbatch script for `cfg` (already through job_config), running the snapshot in `snapshot`."""
    q = shlex.quote
    name = opts.job_name or f"shardlab-{Path(cfg.output_dir).name}"
    directives = [f"--job-name={name}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    if cfg.device != "cpu":
        directives.append(f"--gpus-per-node={cfg.gpus}")
    cpus, _ = cpus_per_task(cfg, opts)
    for flag, value in (("cpus-per-task", cpus), ("mem", opts.mem), ("time", opts.time), ("partition", opts.partition), ("account", opts.account)):
        if value is not None:
            directives.append(f"--{flag}={value}")
    directives += [f"--output={snapshot}/slurm-%j.out", "--open-mode=append", "--requeue"]
    if opts.signal_lead_s:
        directives.append(f"--signal=USR1@{opts.signal_lead_s}")
    directives += opts.sbatch_args
    train = [opts.python, "-m", "shardlab", "train", "--config", str(snapshot / "config.yaml"), "--master-port"]
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
             f"# Written by `shardlab slurm` on {_dt.datetime.now().isoformat(timespec='seconds')}. It runs the shardlab code and the",
             "# config copied next to it, not what is on disk when the job starts.",
             "# Every node needs these on a shared filesystem:",
             *(f"#   {path}" for path in shared_paths(cfg, snapshot)),
             *([f"# NVMe swap ({cfg.strategy_options.nvme_path}) is per node: local disk is right"] if spec(cfg.strategy).offload_params == "nvme" else []),
             "set -u", *opts.setup, "",
             f"export PYTHONPATH={q(str(snapshot / 'code'))}${{PYTHONPATH:+:$PYTHONPATH}}",
             f"export {NODE_AGENT_ENV}=slurm  # each srun task launches its node's workers (see shardlab/launch/nodes.py)",
             "export PYTHONUNBUFFERED=1",
             "# a free port on this (the first) node, where node 0's workers meet the others",
             f"MASTER_PORT=$({q(opts.python)} -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])')",
             'echo "[shardlab] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
             "",
             "# One task per node; the workers meet at the allocation's first host.",
             f'srun --ntasks-per-node=1 --kill-on-bad-exit=1 {" ".join(q(a) for a in train)} "$MASTER_PORT" &',
             "step=$!",
             "# SLURM signals this shell too (preemption, scancel, requeue): keep waiting while the step checkpoints.",
             "trap 'echo \"[shardlab] the batch shell got a signal; waiting for training to checkpoint\"' TERM USR1",
             'while true; do wait "$step"; code=$?; kill -0 "$step" 2>/dev/null || break; done',
             f'if [ "$code" -eq {REQUEUE_EXIT} ]; then',
             '  echo "[shardlab] training checkpointed on a signal: requeueing job $SLURM_JOB_ID; it resumes from the checkpoint"',
             '  scontrol requeue "$SLURM_JOB_ID"',
             "fi",
             'exit "$code"', ""]  # fmt: skip
    return "\n".join(lines)


def _package_dir() -> Path:
    return Path(__file__).resolve().parents[1]  # src/shardlab: this file is in launch/


def _git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def prepare(cfg: RunConfig, opts: SlurmOptions) -> SlurmJob:
    """Validate, snapshot code + config into output_dir/slurm/<stamp>/ (atomically), write the script."""
    _check(cfg, opts)
    cfg = job_config(cfg)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    snapshot = Path(cfg.output_dir) / "slurm" / stamp
    tmp = snapshot.with_name(stamp + ".tmp")
    try:
        tmp.mkdir(parents=True)
        shutil.copytree(_package_dir(), tmp / "code" / "shardlab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (tmp / "config.yaml").write_text(dump_config(cfg, given_only=True))
        script = render(cfg, opts, snapshot)
        (tmp / SCRIPT_NAME).write_text(script)
        (tmp / SCRIPT_NAME).chmod(0o755)
        provenance = {"submitted": _dt.datetime.now().isoformat(timespec="seconds"), "shardlab_source": str(_package_dir()),
                      "git_commit": _git_commit(_package_dir()), "argv": sys.argv}  # fmt: skip
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=1))
        os.replace(tmp, snapshot)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SlurmJob(snapshot, snapshot / SCRIPT_NAME, ["sbatch", "--parsable", str(snapshot / SCRIPT_NAME)])


def submit(job: SlurmJob) -> SlurmJob:
    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH (not a SLURM login node?)", f"run `{' '.join(job.command)}` where SLURM is available")
    proc = subprocess.run(job.command, capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise UserError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}", f"fix the options, then run `{' '.join(job.command)}`")
    job.job_id = proc.stdout.strip().split(";")[0]
    (job.snapshot / "job_id").write_text(job.job_id + "\n")
    return job
