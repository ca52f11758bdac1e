"""The `shardlab` command line: thin parsing in front of library functions.

Every `train` flag mirrors one RunConfig key (FLAGS below is the single table), so
`--micro-batch 2` and `micro_batch: 2` in YAML are the same thing; flags override YAML.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from .config import STRATEGIES
from .errors import UserError, say

# (flag, config key, type, help). type "bool" gives --flag / --no-flag.
FLAGS: list[tuple[str, str, Any, str]] = [
    ("--model", "model", str, "preset (tiny-gpt2, gpt2-medium, bloom-560m, ...), hub id or local directory"),
    ("--tokenizer", "tokenizer", str, "tokenizer hub id or directory (default: the model's own / offline GPT-2 BPE)"),
    ("--dataset", "dataset.source", str, "'offline', 'synthetic', wikitext-2-raw-v1, squad, a hub id or a local file/dir"),
    ("--format", "dataset.format", str, "lm (plain text) or qa (Question/Context/Answer)"),
    ("--num-samples", "dataset.num_samples", int, "use only the first N training examples"),
    ("--eval-split", "dataset.eval_split", float, "fraction held out for eval when the source has no eval split"),
    ("--packing", "dataset.packing", str, "pack (full blocks, default) or pad (per example, as the tutorials do)"),
    ("--answer-only-loss", "dataset.answer_only_loss", "bool", "qa: loss on answer tokens only"),
    ("--seq-len", "seq_len", int, "tokens per sequence"),
    ("--micro-batch", "micro_batch", "int|auto", "sequences per GPU per forward pass, or 'auto' (largest that runs: plan + short trials)"),
    ("--grad-accum", "grad_accum", int, "micro-batches accumulated per optimizer step"),
    ("--global-batch", "global_batch", int, "sequences per optimizer step over all GPUs (= micro x accum x world)"),
    ("--cpu-memory-budget-gb", "cpu_memory_budget_gb", float, "--micro-batch auto on CPU: host RAM the run may use (default: half the available)"),
    ("--epochs", "epochs", float, "epochs to train (fractions allowed)"),
    ("--max-steps", "max_steps", int, "stop after this many optimizer steps"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--warmup-steps", "warmup_steps", int, "linear warm-up steps"),
    ("--lr-schedule", "lr_schedule", str, "cosine, linear or constant after warm-up"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (matrices only)"),
    ("--max-grad-norm", "max_grad_norm", float, "gradient clipping norm"),
    ("--precision", "precision", str, "auto, bf16, fp16 or fp32"),
    ("--strategy", "strategy", str, ", ".join(STRATEGIES)),
    ("--deepspeed-config", "deepspeed_config", str, "your own DeepSpeed JSON ('auto' values are filled in)"),
    ("--pin-memory", "strategy_options.pin_memory", "bool", "page-locked CPU buffers for offload"),
    ("--nvme-path", "strategy_options.nvme_path", str, "infinity: swap directory on local NVMe"),
    ("--stages", "strategy_options.pp_stages", int, "pipeline: ranks the layers are split over (default: all)"),
    ("--microbatches", "grad_accum", int, "pipeline: micro-batches per step (= --grad-accum)"),
    ("--schedule", "strategy_options.pp_schedule", str, "pipeline: gpipe, 1f1b or interleaved-1f1b"),
    ("--chunks", "strategy_options.pp_chunks", int, "pipeline, interleaved-1f1b: model chunks per rank"),
    ("--gradient-checkpointing", "gradient_checkpointing", "bool", "recompute activations in backward"),
    ("--attn-implementation", "attn_implementation", str, "auto, sdpa, eager or flash_attention_2"),
    ("--dropout", "dropout", float, "override the model's dropout probabilities"),
    ("--trust-remote-code", "trust_remote_code", "bool", "allow model code from the hub (off by default)"),
    ("--compile", "compile", "bool", "torch.compile the model"),
    ("--device", "device", str, "auto, cuda or cpu"),
    ("--gpus", "gpus", int, "processes (GPUs) per node; on CPU the number of worker processes"),
    ("--nodes", "nodes", int, "number of nodes"),
    ("--node-rank", "node_rank", int, "this node's index"),
    ("--master-addr", "master_addr", str, "address of node 0"),
    ("--master-port", "master_port", int, "port on node 0"),
    ("--hostfile", "hostfile", str, "DeepSpeed-style hostfile ('host slots=N'): nodes, GPUs per node, master, node rank"),
    ("--dist-timeout", "dist_timeout_s", int, "seconds a collective waits for a silent rank before failing"),
    ("--seed", "seed", int, "random seed"),
    ("--output-dir", "output_dir", str, "run directory"),
    ("--resume", "resume", str, "'auto' or a checkpoint directory"),
    ("--log-every", "log_every", int, "optimizer steps between metrics rows"),
    ("--eval-every", "eval_every", int, "optimizer steps between evals (default: each epoch)"),
    ("--eval-at-start", "eval_at_start", "bool", "evaluate before the first step (initial_eval_loss; default on)"),
    ("--early-stopping-patience", "early_stopping_patience", int, "stop after N evaluations without a new best eval loss"),
    ("--save-best", "save_best", "bool", "keep the best-eval checkpoint (checkpoints/best) and export that step"),
    ("--samples", "samples", "bool", "write samples.md: greedy completions of fixed prompts before and after training"),
    ("--save-every", "save_every", int, "optimizer steps between checkpoints"),
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
    from .launch import WorkerFailed
    from .preemption import Preempted

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


def _parse_set(values: list[str]) -> dict[str, Any]:
    from .config import _YamlLoader

    out: dict[str, Any] = {}
    for item in values:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE", "write e.g. --set strategy_options.overlap_comm=false")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.load(raw, Loader=_YamlLoader)  # noqa: S506 - SafeLoader subclass; reads 5e-5 as a float like --config does
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: {raw!r} is not a valid YAML value", "quote strings, e.g. --set 'key=\"a: b\"'") from None
    return out


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML run configuration (flags override it)")
    for flag, key, typ, help_text in FLAGS:
        dest = key.replace(".", "__")
        if typ == "bool":
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typ == "int|auto":
            parser.add_argument(flag, dest=dest, type=_int_or_auto, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=typ, default=None, help=help_text)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config key, dotted (YAML value)")


def config_from_args(args: argparse.Namespace):
    from .config import load_config

    overrides = {key: getattr(args, key.replace(".", "__")) for _, key, _, _ in FLAGS}
    return load_config(args.config, overrides, _parse_set(args.set))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage wall -> our one line
        raise UserError(message, f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shardlab", description="Fine-tune HF causal LMs under DDP, DeepSpeed ZeRO and FSDP2, measured honestly.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    tr = sub.add_parser("train", help="train a model (spawns its own worker processes)")
    add_run_flags(tr)
    tr.add_argument("--dry-run", action="store_true", help="print the resolved config and DeepSpeed JSON, then exit")
    _add_plan_parser(sub)  # `plan`: predicted memory per strategy
    from .pipesim.cli import add_pipeline_parser

    add_pipeline_parser(sub, _Parser)  # `pipeline simulate`
    from .bench.cli import add_bench_parser, add_report_parser

    add_bench_parser(sub)  # `bench`: a matrix of runs
    add_report_parser(sub)  # `report`: tables, plots, HTML from run directories
    from .cluster_cli import add_cluster_parsers

    add_cluster_parsers(sub, add_run_flags)  # `slurm`, `export`
    from .generate import add_generate_parser

    add_generate_parser(sub)  # `generate`: completions from a run's exported model
    return parser


def cmd_train(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    if args.dry_run:
        _dry_run(cfg)
        return
    from .launch import train

    train(cfg)


def _dry_run(cfg) -> None:
    import json

    from .config import dump_config
    from .launch import preflight
    from .optim import resolve_precision
    from .strategies import uses_deepspeed

    device_type, nproc = preflight(cfg)
    world = nproc * cfg.nodes
    if cfg.micro_batch == "auto":  # no trials in a dry run: show where the search would start
        from .autobatch import cpu_budget_bytes, plan_start, with_micro_batch

        start, note = plan_start(cfg, device_type, nproc, world, None if device_type == "cuda" else cpu_budget_bytes(cfg))
        print(f"# micro_batch auto: the search would start at {start} ({note}); `train` confirms it with short trial runs")
        cfg = with_micro_batch(cfg, start)
    micro, accum, glob = cfg.resolve_batch(world)
    print(dump_config(cfg.model_copy(update={"micro_batch": micro, "grad_accum": accum, "global_batch": glob})), end="")
    if uses_deepspeed(cfg.strategy):
        from .strategies.deepspeed_zero import resolved_ds_config

        precision = resolve_precision(cfg.precision, device_type).name
        ds = resolved_ds_config(cfg, precision, micro, accum, world, device_type)
        print("# DeepSpeed config")
        print(json.dumps(ds, indent=2))


def cmd_pipeline(args: argparse.Namespace) -> None:
    from .pipesim.cli import cmd_pipeline as run

    run(args)


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="predict per-GPU/CPU/NVMe memory of every strategy and recommend one (no GPU needed)")
    add_run_flags(pl)
    pl.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU in GiB, e.g. 80 for an H100 80GB (default: detected; required without a GPU)")
    pl.add_argument("--host-ram-gb", type=float, default=None, help="CPU RAM per node in GiB (checked for offload)")
    pl.add_argument("--nvme-free-gb", type=float, default=None, help="free NVMe space per node in GiB (checked for infinity)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(args: argparse.Namespace) -> None:
    from .planner import plan, render

    cfg = config_from_args(args)
    result = plan(cfg, gpu_memory_gb=args.gpu_memory_gb, host_ram_gb=args.host_ram_gb, nvme_free_gb=args.nvme_free_gb)
    if args.json:
        print(result.to_json())
    else:
        render(result)


def main(argv: list[str] | None = None) -> int:
    with report_errors() as status:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # argparse reports these from the top-level parser, whose --help lists no command's flags
            raise UserError(f"unrecognized arguments: {' '.join(unknown)}", f"see `shardlab {args.command} --help`")
        from .bench.cli import cmd_bench, cmd_report
        from .cluster_cli import cmd_export, cmd_slurm
        from .generate import cmd_generate

        commands = {"train": cmd_train, "pipeline": cmd_pipeline, "plan": cmd_plan, "bench": cmd_bench, "report": cmd_report,
                    "export": cmd_export, "generate": cmd_generate, "slurm": lambda a: cmd_slurm(a, config_from_args)}  # fmt: skip
        commands[args.command](args)
    return status.code


if __name__ == "__main__":
    sys.exit(main())
