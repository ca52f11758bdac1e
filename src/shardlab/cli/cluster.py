"""The `slurm` and `export` subcommands (thin: parse, then call slurm.py / export.py)."""

from __future__ import annotations

import argparse
import shlex
import sys

from .. import messages

# Lazy imports below: launch.slurm and checkpoint.export load torch, which `shardlab --help` must not (cli/__init__.py).


def add_cluster_parsers(sub, add_run_flags) -> None:
    sl = sub.add_parser("slurm", help="write an sbatch script for a run (code and config snapshotted), print or submit it")
    add_run_flags(sl)
    sl.add_argument("--partition", help="SLURM partition")
    sl.add_argument("--account", help="SLURM account")
    sl.add_argument("--time", help="time limit, e.g. 04:00:00 or 1-00:00:00")
    sl.add_argument("--mem", help="memory per node, e.g. 64G")
    sl.add_argument("--cpus-per-task", type=int, help="CPU cores per node for its workers (one task per node)")
    sl.add_argument("--job-name", help="job name (default: shardlab-<output dir name>)")
    sl.add_argument("--setup", action="append", default=[], metavar="LINE", help="shell line before training, e.g. 'module load cuda/12.4' or 'source venv/bin/activate' (repeatable)")
    sl.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS", help="SIGUSR1 this long before the time limit: checkpoint and requeue (default 300; 0: none)")
    sl.add_argument("--python", default=None, help="python on the compute nodes (default: this one; 'python' after --setup that activates an environment)")
    sl.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG", help="extra sbatch option, e.g. --sbatch-arg=--qos=short (repeatable)")
    sl.add_argument("--submit", action="store_true", help="run sbatch (default: print the command)")
    ex = sub.add_parser("export", help="write any checkpoint (any strategy) as a Hugging Face model + tokenizer (--peft "
                        "runs: peft's adapter directory, or the merged model with --merge)")
    ex.add_argument("checkpoint", help="OUTPUT_DIR/checkpoints/step-N, or OUTPUT_DIR for its newest checkpoint")
    ex.add_argument("out", help="new directory for the model (from_pretrained loads it)")
    ex.add_argument("--trust-checkpoint", action="store_true",
                    help="read a checkpoint that shardlab did not write for this user even where its pickles hold more "
                         "than tensors and plain data (reading it may run its code)")
    ex.add_argument("--merge", action="store_true", help="a --peft checkpoint: the base model with its adapters merged in "
                    "(a plain transformers model) instead of peft's adapter directory")


def cmd_slurm(args: argparse.Namespace, config_from_args) -> None:
    from ..launch.slurm import SlurmOptions, cpus_per_task, job_config, prepare, shared_paths, submit

    cfg = config_from_args(args)
    opts = SlurmOptions(partition=args.partition, account=args.account, time=args.time, mem=args.mem, cpus_per_task=args.cpus_per_task,
                        job_name=args.job_name, setup=args.setup, signal_lead_s=args.signal_lead, python=args.python or sys.executable,
                        sbatch_args=args.sbatch_arg)  # fmt: skip
    job = prepare(cfg, opts)
    messages.info(f"code and config snapshotted in {job.snapshot}")
    _, cpus_note = cpus_per_task(cfg, opts)
    if cpus_note:
        messages.info(cpus_note)
    messages.info(f"every node needs on a shared filesystem: {'; '.join(shared_paths(job_config(cfg), job.snapshot))}")
    if args.submit:
        submit(job)
        messages.info(f"submitted job {job.job_id}; log: {job.snapshot}/slurm-{job.job_id}.out")
    else:
        print(shlex.join(job.command))


def cmd_export(args: argparse.Namespace) -> None:
    from ..checkpoint.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, merge=args.merge, trusted=args.trust_checkpoint)
    messages.info(f"exported {args.checkpoint} to {out}")
