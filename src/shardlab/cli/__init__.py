"""The `shardlab` command line: thin parsing in front of library functions.

Every `train` flag is one RunConfig key: FLAGS is built from the config fields that name a flag (config.cli),
with their descriptions as help and their defaults stated, so `--micro-batch 2` and `micro_batch: 2` in YAML are
the same thing, documented once; flags override YAML.

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
import logging
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel

from ..config import RunConfig, dump_config, load_config, parse_set
from .. import messages
from ..errors import UserError
from ..bench.cli import add_bench_parser, add_report_parser, cmd_bench, cmd_report
from ..launch.failures import report_errors  # worker.py's too; callers also import it from here
from ..launch.supervise import exit_as, supervise, wanted
from ..pipesim.cli import add_pipeline_parser, cmd_pipeline as run_pipeline
from ..specs.registry import spec
from ..loop.generate import add_generate_parser, cmd_generate
from .cluster import add_cluster_parsers, cmd_export, cmd_slurm

def _flag_type(annotation: Any) -> Any:
    """What argparse parses a field's value as: "bool" (--flag / --no-flag), "int|auto", or int, float, str."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = [a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)]
    literals = [a for a in members if typing.get_origin(a) is typing.Literal]
    if bool in members:
        return "bool"
    if int in members and literals:
        return "int|auto"
    for typ in (int, float, str):
        if typ in members:
            return typ
    return type(typing.get_args(literals[0])[0])


def _section(field) -> type | None:
    """The config model a field holds (``dataset`` -> DatasetConfig), or None for a plain value."""
    model = field.default_factory if field.default_factory is not None else field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _config_flags(model: type = RunConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(flag, config key, type, help) of every field that names its flag (config.cli), nested sections in place,
    in the config's order: the flags are the config's own, with its descriptions as their help."""
    out = []
    for name, field in model.model_fields.items():
        if _section(field) is not None:
            out += _config_flags(_section(field), f"{prefix}{name}.")
            continue
        spec_ = (field.json_schema_extra or {}).get("cli") if isinstance(field.json_schema_extra, dict) else None
        if spec_:
            typ = _flag_type(field.annotation)
            out.append((spec_["flag"], prefix + name, typ, field.description or ""))
            out += [(flag, prefix + name, typ, text) for flag, text in spec_["also"].items()]
    return out


# Every `train` flag: (flag, config key, type, help); type "bool" gives --flag / --no-flag.
FLAGS: list[tuple[str, str, Any, str]] = _config_flags()


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
        model = _section(model.model_fields[part])
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
        # argparse %-formats help: a literal % in a description ("top 10%") must be doubled
        text, metavar = _with_default(key, help_text).replace("%", "%%"), _metavar(flag, key, typ)
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


def train_flags_config(argv: list[str]) -> dict:
    """`shardlab train` flags as the RunConfig keys they give (nested; what a bench's cells file holds per line)."""
    import yaml

    parser = _Parser(prog="shardlab train")
    add_run_flags(parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)}", "see `shardlab train --help`")
    return yaml.safe_load(dump_config(config_from_args(args), given_only=True))


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
    _add_log_flags(parser)
    return parser


def _add_log_flags(parser: argparse.ArgumentParser) -> None:
    """--log-level and --quiet on every command (shardlab.messages: the level of the command and its workers)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                if not isinstance(command, argparse.ArgumentParser):
                    continue
                if any(isinstance(a, argparse._SubParsersAction) for a in command._actions):
                    _add_log_flags(command)
                    continue
                command.add_argument("--log-level", choices=messages.LEVELS, default=None,
                                     help="the least important '[shardlab] ...' line shown (default: info)")
                command.add_argument("--quiet", "-q", action="store_true", help="only warnings and errors (--log-level warning)")


def cmd_train(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    if args.dry_run:
        _dry_run(cfg)
        return
    from ..launch.launcher import train

    train(cfg, force=args.force)


def _dry_run(cfg) -> None:
    from ..runtime.distributed import pick_device_type
    from ..runtime.resolved import job_world
    from ..launch.launcher import (check_tokenizer, preflight, quiet_engines, stale_run_files, weights_not_kept_note,
                                   with_user_deepspeed_json)
    from ..launch.nodes import single_machine_note
    from ..launch.run_lock import check_no_live_run
    from ..training.cpu_bf16 import slow_bf16_note

    device_type = pick_device_type(cfg.device)
    quiet_engines(device_type)  # DeepSpeed, imported to check a user's JSON, names its accelerator otherwise
    for note in (single_machine_note(cfg), weights_not_kept_note(cfg)):
        if note:
            print(f"# {note}")
    cfg = with_user_deepspeed_json(cfg, device_type, say=lambda m: print(f"# {m}"))  # comments: the output stays YAML
    cfg, note = cfg.with_pipeline_microbatches(job_world(cfg, device_type))  # train's world: torchrun's or srun's too
    if note:
        print(f"# {note}")  # a YAML comment: the dry run's output stays a loadable config
    run = preflight(cfg, device_type)
    slow = slow_bf16_note(run.precision.name, device_type)
    if slow:
        print(f"# {slow}")
    for check in (lambda c: check_no_live_run(c.output_dir), stale_run_files, check_tokenizer):
        try:
            check(cfg)
        except UserError as err:  # a dry run writes nothing: say what `train` would refuse
            print(f"# note: `train` would refuse this: {err}")
    if cfg.micro_batch == "auto":  # no trials in a dry run: show where the search would start
        from ..planning.autobatch import cpu_budget_bytes, plan_start, with_micro_batch

        start, note = plan_start(cfg, device_type, run.nproc, run.world, None if device_type == "cuda" else cpu_budget_bytes(cfg))
        print(f"# micro_batch auto: the search would start at {start} ({note}); `train` confirms it with short trial runs")
        run = run.with_config(with_micro_batch(cfg, start))
        cfg = run.cfg

    micro, accum, glob, world = run.micro, run.accum, run.global_batch, run.world  # a pipeline's stages share one batch
    print(dump_config(cfg.model_copy(update={"micro_batch": micro, "grad_accum": accum, "global_batch": glob})), end="")
    if spec(cfg.strategy).engine == "deepspeed":
        from ..strategies.deepspeed_config import resolved_ds_config

        from ..planning.arch import arch_from_hf_config
        from ..training.models import build_hf_config

        precision = run.precision.name
        arch = arch_from_hf_config(build_hf_config(cfg), name=cfg.model)  # the model's size and width size the buckets
        # The leaf classes (one-rank ZeRO-3) repeat DeepSpeed's own defaults, read from DeepSpeed, which logs its
        # accelerator to stdout on first use: to stderr here, so that the output stays YAML then JSON.
        with contextlib.redirect_stdout(sys.stderr):  # a logger made now binds to stderr; one made before is moved
            for handler in logging.getLogger("DeepSpeed").handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stdout__:
                    handler.setStream(sys.stderr)
            ds = resolved_ds_config(cfg, precision, micro, accum, world, device_type, n_params=arch.n_params,
                                    hidden=arch.hidden, leaf_classes=list(arch.leaf_classes))
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
                    "Needs no GPU: without one, say how much memory a GPU has with --gpu-memory-gb. With --device cpu, "
                    "the host memory of a run on this machine's CPU under every strategy.")
    pl.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GIB",
                    help="memory per GPU in GiB, e.g. 80 for an H100 80GB (default: detected; required without a GPU)")
    pl.add_argument("--host-ram-gb", type=float, default=None, metavar="GIB", help="CPU RAM per node in GiB (default: this machine's; with --device cpu, what is available now)")
    pl.add_argument("--nvme-free-gb", type=float, default=None, metavar="GIB", help="free NVMe space per node in GiB, checked for infinity (default: not checked)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_run_flags(pl.add_argument_group("run configuration (the flags of `shardlab train`)"))


def cmd_plan(args: argparse.Namespace) -> None:
    from ..planning.planner import plan
    from ..planning.render import render

    cfg = config_from_args(args)
    if cfg.peft.method and cfg.device == "cpu":
        raise UserError(f"--peft {cfg.peft.method} --device cpu: the CPU plan does not model adapters yet",
                        "plan it for GPUs (--gpu-memory-gb), or drop --peft")
    if cfg.device == "cpu":  # a run on this machine's CPU: its host memory is the one figure (planning/cpu_plan.py)
        from ..runtime.distributed import processes_per_node
        from ..launch.launcher import preflight
        from ..planning.cpu_plan import plan_cpu, render_cpu
        from ..planning.run_plan import host_available_gib

        host = args.host_ram_gb if args.host_ram_gb is not None else host_available_gib()  # what `train` checks
        result = plan_cpu(cfg, processes_per_node(cfg, "cpu"), host, check=preflight)
        print(result.to_json()) if args.json else render_cpu(result)
        return
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

        commands = {"train": cmd_train, "pipeline": cmd_pipeline, "plan": cmd_plan, "bench": lambda a: cmd_bench(a, train_flags_config), "report": cmd_report,
                    "export": cmd_export, "generate": cmd_generate, "slurm": lambda a: cmd_slurm(a, config_from_args)}  # fmt: skip
        with messages.at_level("warning" if getattr(args, "quiet", False) else getattr(args, "log_level", None)):
            commands[args.command](args)
    return status.code


if __name__ == "__main__":
    sys.exit(main())
