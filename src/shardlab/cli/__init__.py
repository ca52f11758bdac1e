"""The `shardlab` command line: thin parsing in front of library functions.

Every `train` flag mirrors one RunConfig key (FLAGS below is the single table), so
`--micro-batch 2` and `micro_batch: 2` in YAML are the same thing; flags override YAML.

The package: this module (cli.py before the packages; `shardlab = shardlab.cli:main`) and cluster.py (the
`slurm` and `export` subcommands). pipeline and bench parsers live in pipesim/cli.py and bench/cli.py.
Commands that need torch or transformers (train, the dry run, plan) import their modules inside the function that
runs them, so that `shardlab --help` loads no torch (tests/test_layout_imports.py checks it); the rest is imported above.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import sys
import typing
from dataclasses import dataclass
from typing import Any

from ..config import STRATEGIES, RunConfig, dump_config, load_config, parse_set
from ..errors import UserError, say
from ..bench.cli import add_bench_parser, add_report_parser, cmd_bench, cmd_report
from ..launch.failures import WorkerFailed
from ..launch.preemption import Preempted
from ..launch.supervise import exit_as, supervise, wanted
from ..pipesim.cli import add_pipeline_parser, cmd_pipeline as run_pipeline
from ..strategies import strategy_class
from ..strategies.spec import spec
from ..training.generate import add_generate_parser, cmd_generate
from .cluster import add_cluster_parsers, cmd_export, cmd_slurm

# (flag, config key, type, help). type "bool" gives --flag / --no-flag.
FLAGS: list[tuple[str, str, Any, str]] = [
    ("--model", "model", str, "preset (tiny-gpt2, gpt2-medium, bloom-560m, ...), hub id or local directory"),
    ("--tokenizer", "tokenizer", str, "tokenizer hub id or directory (default: the model's own / offline GPT-2 BPE)"),
    ("--dataset", "dataset.source", str, "'offline', 'synthetic', wikitext-2-raw-v1, squad, a hub id or a local file/dir"),
    ("--format", "dataset.format", str, "lm (plain text) or qa (Question/Context/Answer)"),
    ("--num-samples", "dataset.num_samples", int, "use only the first N training examples (default: all)"),
    ("--eval-split", "dataset.eval_split", float, "fraction held out for eval when the source has no eval split"),
    ("--packing", "dataset.packing", str, "pack (full blocks, default) or pad (per example, as the tutorials do)"),
    ("--answer-only-loss", "dataset.answer_only_loss", "bool", "qa: loss on answer tokens only"),
    ("--seq-len", "seq_len", int, "tokens per sequence"),
    ("--micro-batch", "micro_batch", "int|auto", "sequences per GPU per forward pass, or 'auto' (largest that runs: plan + short trials) (default: 8, or from --global-batch)"),
    ("--grad-accum", "grad_accum", int, "micro-batches accumulated per optimizer step (default: 1, or from --global-batch)"),
    ("--global-batch", "global_batch", int, "sequences per optimizer step over all GPUs (default: micro x accum x world)"),
    ("--cpu-memory-budget-gb", "cpu_memory_budget_gb", float, "--micro-batch auto on CPU: host RAM the run may use (default: half the available)"),
    ("--epochs", "epochs", float, "epochs to train, fractions allowed (default: 1, unless --max-steps is given)"),
    ("--max-steps", "max_steps", int, "stop after this many optimizer steps (default: no limit, the epochs decide)"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--warmup-steps", "warmup_steps", int, "linear warm-up steps"),
    ("--lr-schedule", "lr_schedule", str, "cosine, linear or constant after warm-up"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (matrices only)"),
    ("--max-grad-norm", "max_grad_norm", float, "gradient clipping norm"),
    ("--optimizer", "optimizer", str, "adamw (exact fp32 AdamW) or adamw8bit (torchao 8-bit moments; dp, fsdp)"),
    ("--optimizer-in-backward", "optimizer_in_backward", "bool", "step each parameter in its gradient hook, free its gradient at once (dp, fsdp)"),
    ("--offload-ratio", "strategy_options.offload_ratio", float, "zero3_offload: fraction of optimizer states on the CPU (rest steps on the GPU)"),
    ("--zenflow", "strategy_options.zenflow", "bool", "zero1/2_offload: DeepSpeed ZenFlow (faster, NOT bit-exact AdamW)"),
    ("--precision", "precision", str, "auto, bf16, fp16 or fp32"),
    ("--strategy", "strategy", str, ", ".join(STRATEGIES)),
    ("--deepspeed-config", "deepspeed_config", str, "your own DeepSpeed JSON, 'auto' values filled in (default: none, shardlab writes the whole JSON)"),
    ("--pin-memory", "strategy_options.pin_memory", "bool", "page-locked CPU buffers for offload"),
    ("--nvme-path", "strategy_options.nvme_path", str, "infinity: swap directory on local NVMe (no default: infinity needs it)"),
    ("--stages", "strategy_options.pp_stages", int, "pipeline: ranks the layers are split over (default: all)"),
    ("--microbatches", "grad_accum", int, "pipeline: micro-batches per step (the same setting as --grad-accum, and the same default)"),
    ("--schedule", "strategy_options.pp_schedule", str, "pipeline: gpipe, 1f1b or interleaved-1f1b"),
    ("--chunks", "strategy_options.pp_chunks", int, "pipeline, interleaved-1f1b: model chunks per rank"),
    ("--gradient-checkpointing", "gradient_checkpointing", "bool", "recompute activations in backward"),
    ("--attn-implementation", "attn_implementation", str, "auto, sdpa, eager or flash_attention_2"),
    ("--dropout", "dropout", float, "override the model's dropout probabilities (default: the model's own)"),
    ("--trust-remote-code", "trust_remote_code", "bool", "allow model code from the hub (off by default)"),
    ("--compile", "compile", "bool", "torch.compile the model"),
    ("--device", "device", str, "auto, cuda or cpu"),
    ("--gpus", "gpus", int, "processes (GPUs) per node; on CPU the number of worker processes (default: every visible GPU; 1 on CPU)"),
    ("--nodes", "nodes", int, "number of nodes"),
    ("--node-rank", "node_rank", int, "this node's index"),
    ("--master-addr", "master_addr", str, "address of node 0"),
    ("--master-port", "master_port", int, "port on node 0"),
    ("--hostfile", "hostfile", str, "DeepSpeed-style hostfile ('host slots=N'): nodes, GPUs per node, master, node rank (default: none, the flags decide)"),
    ("--dist-timeout", "dist_timeout_s", int, "seconds a collective waits for a silent rank before failing"),
    ("--seed", "seed", int, "random seed"),
    ("--output-dir", "output_dir", str, "run directory"),
    ("--resume", "resume", str, "'auto' or a checkpoint directory (default: start fresh)"),
    ("--overwrite", "overwrite", "bool", "the output dir holds another run: delete its files first (else refused)"),
    ("--log-every", "log_every", int, "optimizer steps between metrics rows"),
    ("--eval-every", "eval_every", int, "optimizer steps between evals (default: each epoch)"),
    ("--eval-at-start", "eval_at_start", "bool", "evaluate before the first step (initial_eval_loss; default on)"),
    ("--early-stopping-patience", "early_stopping_patience", int, "stop after N evaluations without a new best eval loss"),
    ("--save-best", "save_best", "bool", "keep the best-eval checkpoint (checkpoints/best) and export that step"),
    ("--samples", "samples", "bool", "write samples.md: greedy completions of fixed prompts before and after training"),
    ("--save-every", "save_every", int, "optimizer steps between checkpoints (default: no periodic checkpoints)"),
    ("--save-each-epoch", "save_each_epoch", "bool", "also checkpoint at the end of every epoch"),
    ("--keep-checkpoints", "keep_checkpoints", int, "how many recent checkpoints to keep"),
    ("--nan-policy", "nan_policy", str, "non-finite loss/gradients: stop (naming the step) or skip the step"),
    ("--export", "export", "bool", "save the final model in HF format"),
    ("--tensorboard", "tensorboard", "bool", "log to TensorBoard"),
    ("--wandb", "wandb", "bool", "log to Weights & Biases"),
    ("--profile", "profile", "bool", "torch.profiler trace + op table of a few steady-state steps (output_dir/profile)"),
]


@dataclass
class _Status:
    code: int = 0


@contextlib.contextmanager
def report_errors():
    """Turn user mistakes into one line on stderr and a non-zero status; bugs keep their traceback."""
    status = _Status()
    try:
        yield status
    except Preempted as err:  # not a failure: the run checkpointed and wants to be requeued
        if os.environ.get("RANK") in (None, "0"):
            say(f"[shardlab] {err}")
        status.code = err.exit_code
    except UserError as err:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        say(f"{prefix}error: {err}")
        status.code = err.exit_code
    except WorkerFailed as err:
        say(f"{'[shardlab]' if err.exitcode == Preempted.exit_code else 'error:'} {err}")
        status.code = err.exitcode
    except KeyboardInterrupt:
        say("interrupted")
        status.code = 130



def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def _field(key: str):
    """The pydantic field behind a dotted config key (``dataset.source`` -> DatasetConfig.source)."""
    model, *parents = RunConfig, *key.split(".")[:-1]
    for part in parents:
        field = model.model_fields[part]
        model = field.default_factory if field.default_factory is not None else field.annotation
    return model.model_fields[key.split(".")[-1]]


def _metavar(flag: str, key: str, typ: Any) -> str | None:
    """What a flag's value is, in the user's words: the choices of a Literal, else the key's own name
    (``--dataset SOURCE``, not argparse's ``DATASET__SOURCE``); the flag's name where two flags share a key."""
    if typ == "bool":
        return None
    choices = [a for t in (_field(key).annotation, *typing.get_args(_field(key).annotation)) for a in typing.get_args(t)
               if typing.get_origin(t) is typing.Literal]
    if choices and typ == "int|auto":
        return "N|" + "|".join(map(str, choices))
    if choices:
        return "{" + ",".join(map(str, choices)) + "}"
    if sum(k == key for _, k, _, _ in FLAGS) > 1:
        return flag.lstrip("-").replace("-", "_").upper()
    return key.split(".")[-1].removeprefix("pp_").upper()


def _with_default(key: str, help_text: str) -> str:
    """The help text with the config default appended, unless the text already explains it."""
    if "default" in help_text:
        return help_text
    field = _field(key)
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        shown = "not set"
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    else:
        shown = value.value if isinstance(value, enum.Enum) else value
    return f"{help_text} (default: {shown})"


def add_run_flags(parser) -> None:
    """Every FLAGS entry on ``parser`` (a parser or an argument group), with its metavar and config default."""
    parser.add_argument("--config", "-c", metavar="YAML", help="YAML run configuration (flags override it)")
    for flag, key, typ, help_text in FLAGS:
        dest = key.replace(".", "__")
        text, metavar = _with_default(key, help_text), _metavar(flag, key, typ)
        if typ == "bool":
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif typ == "int|auto":
            parser.add_argument(flag, dest=dest, type=_int_or_auto, default=None, metavar=metavar, help=text)
        else:
            parser.add_argument(flag, dest=dest, type=typ, default=None, metavar=metavar, help=text)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config key, dotted (YAML value)")


def config_from_args(args: argparse.Namespace):
    overrides = {key: getattr(args, key.replace(".", "__")) for _, key, _, _ in FLAGS}
    return load_config(args.config, overrides, parse_set(args.set))


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every real default shown; a None default means "not given" (the config decides,
    and add_run_flags states the config's default), a store_true flag is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or action.default == [] or "default" in text
                or not action.option_strings or action.help == argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's usage wall -> our one line
        raise UserError(message, f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardlab", description="Fine-tune HF causal LMs under DDP, DeepSpeed ZeRO and FSDP2, measured honestly.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    tr = sub.add_parser("train", help="train a model (spawns its own worker processes)")
    add_run_flags(tr)
    tr.add_argument("--dry-run", action="store_true", help="print the resolved config and DeepSpeed JSON, then exit")
    tr.add_argument("--force", action="store_true", help="start even when the plan predicts more host RAM than this node has")
    _add_plan_parser(sub)  # `plan`: predicted memory per strategy

    add_pipeline_parser(sub, _Parser)  # `pipeline simulate`

    add_bench_parser(sub)  # `bench`: a matrix of runs
    add_report_parser(sub)  # `report`: tables, plots, HTML from run directories

    add_cluster_parsers(sub, add_run_flags)  # `slurm`, `export`

    add_generate_parser(sub)  # `generate`: completions from a run's exported model
    return parser


def cmd_train(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    if args.dry_run:
        _dry_run(cfg)
        return
    from ..launch.launcher import train

    train(cfg, force=args.force)


def _dry_run(cfg) -> None:
    from ..launch.distributed import pick_device_type, processes_per_node
    from ..launch.launcher import preflight, stale_run_files, with_user_deepspeed_json
    from ..training.optim import resolve_precision

    cfg = with_user_deepspeed_json(cfg, say=lambda m: print(f"# {m}"))  # comments: the output stays YAML
    cfg, note = cfg.with_pipeline_microbatches(processes_per_node(cfg, pick_device_type(cfg.device)) * cfg.nodes)
    if note:
        print(f"# {note}")  # a YAML comment: the dry run's output stays a loadable config
    device_type, nproc = preflight(cfg)
    try:
        stale_run_files(cfg)
    except UserError as err:  # a dry run writes nothing: say what `train` would refuse
        print(f"# note: `train` would refuse this: {err}")
    world = nproc * cfg.nodes
    if cfg.micro_batch == "auto":  # no trials in a dry run: show where the search would start
        from ..planning.autobatch import cpu_budget_bytes, plan_start, with_micro_batch

        start, note = plan_start(cfg, device_type, nproc, world, None if device_type == "cuda" else cpu_budget_bytes(cfg))
        print(f"# micro_batch auto: the search would start at {start} ({note}); `train` confirms it with short trial runs")
        cfg = with_micro_batch(cfg, start)

    micro, accum, glob = cfg.resolve_batch(strategy_class(cfg.strategy).data_parallel_size(cfg, world))  # a pipeline's stages share one batch
    print(dump_config(cfg.model_copy(update={"micro_batch": micro, "grad_accum": accum, "global_batch": glob})), end="")
    if spec(cfg.strategy).engine == "deepspeed":
        from ..strategies.deepspeed_zero import resolved_ds_config

        precision = resolve_precision(cfg.precision, device_type).name
        ds = resolved_ds_config(cfg, precision, micro, accum, world, device_type)
        print("# DeepSpeed config")
        print(json.dumps(ds, indent=2))


def cmd_pipeline(args: argparse.Namespace) -> None:
    run_pipeline(args)


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser(
        "plan", help="predict per-GPU/CPU/NVMe memory of every strategy and recommend one (no GPU needed)",
        usage="shardlab plan [--gpu-memory-gb GIB] [--host-ram-gb GIB] [--nvme-free-gb GIB] [--json] [run flags as for `shardlab train`]",
        description="Predict, for the run described by the flags (or --config), the peak memory per GPU of every strategy, "
                    "the host memory per node and the NVMe space it needs, and recommend the fastest strategy that fits. "
                    "Needs no GPU: without one, say how much memory a GPU has with --gpu-memory-gb.")
    pl.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GIB",
                    help="memory per GPU in GiB, e.g. 80 for an H100 80GB (default: detected; required without a GPU)")
    pl.add_argument("--host-ram-gb", type=float, default=None, metavar="GIB", help="CPU RAM per node in GiB (default: this machine's)")
    pl.add_argument("--nvme-free-gb", type=float, default=None, metavar="GIB", help="free NVMe space per node in GiB, checked for infinity (default: not checked)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_run_flags(pl.add_argument_group("run configuration (the flags of `shardlab train`)"))


def cmd_plan(args: argparse.Namespace) -> None:
    from ..planning.planner import plan, render

    cfg = config_from_args(args)
    host = args.host_ram_gb
    if host is None:  # this node's RAM, so the recommendation fits in host memory too
        from ..planning.run_plan import host_ram_gib

        host = host_ram_gib()
    result = plan(cfg, gpu_memory_gb=args.gpu_memory_gb, host_ram_gb=host, nvme_free_gb=args.nvme_free_gb)
    if args.json:
        print(result.to_json())
    else:
        render(result)


def main(argv: list[str] | None = None) -> int:
    with report_errors() as status:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # argparse reports these from the top-level parser, whose --help lists no command's flags
            raise UserError(f"unrecognized arguments: {' '.join(unknown)}", f"see `shardlab {args.command} --help`")
        if argv is None and args.command == "train" and not args.dry_run:  # the process a user started, not a library call

            if wanted():  # a parent that survives the kernel's OOM killer and says what happened (supervise.py)
                cfg = config_from_args(args)  # a bad flag or config: one line here, before any child
                return exit_as(supervise(cfg.output_dir, cfg.strategy))

        commands = {"train": cmd_train, "pipeline": cmd_pipeline, "plan": cmd_plan, "bench": cmd_bench, "report": cmd_report,
                    "export": cmd_export, "generate": cmd_generate, "slurm": lambda a: cmd_slurm(a, config_from_args)}  # fmt: skip
        commands[args.command](args)
    return status.code


if __name__ == "__main__":
    sys.exit(main())
