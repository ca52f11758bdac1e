"""The training loop: one worker process's whole run, strategy-agnostic.

    model + tokenizer -> datasets -> [samples before] -> strategy.setup -> [resume] -> [eval before] -> for each stage, epoch, step:
        the step's micro-batches, their label tokens counted first (batches.py); for each: with strategy.accumulate(last):
            loss = strategy.forward(b); strategy.backward(loss x its label tokens / the step's on all ranks, last)
        strategy.optimizer_step(); log; eval (best checkpoint, early stopping); checkpoint
    -> [load the best checkpoint] -> export (HF format) -> [samples after] -> summary

The loop never asks which strategy it runs; everything engine-specific is behind the
Strategy verbs (strategies/base.py).
"""

from __future__ import annotations

import faulthandler
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from .. import messages
from .. import compat
from ..checkpoint import store as checkpoint, reshard
from ..runtime import faults, guards, pin
from ..measure.startup import StartupClock
from ..measure import metrics, mfu
from ..training import adapters, compiling, head_padding, optim, pinned
from . import warm_8bit
from .evaluation import evaluate
from .reporting import environment_info, log0, print_summary, progress_bar, progress_line
from ..measure.compile_stats import CompileClock, process_start_time, use_persistent_cache
from ..config import RunConfig, dump_config
from ..runtime.distributed import DistEnv, heap_reuse, init_distributed, mark_group_broken, reuse_freed_heap, shutdown_distributed
from ..training.batches import DevicePrefetcher
from ..training.early_stopping import EvalTracker
from ..errors import OutOfMemory, UserError
from ..layout import local_world_size
from ..runtime.resolved import ResolvedRun, resolve_run
from ..runtime.preemption import Preempted, StopSignals
from ..measure.profiling import StepProfiler
from ..training.sampling import SeekableDistributedSampler
from ..strategies import strategy_class
from ..specs.registry import StrategySpec, lookup, spec
from ..measure.summary import RunSummary
from ..data import build_datasets
from .generate import SAMPLE_PROMPTS, SAMPLES_FILE, complete_all, load, samples_markdown
from ..training.models import apply_dropout, build_hf_config, describe_weights, model_summary
from ..training.tokenizing import offline_tokenizer_problem, run_tokenizer, synthetic_vocab

# Lazy import below: wandb is optional (the `wandb` extra); only --wandb runs import it.


@dataclass
class LoopRecord:
    """What the training loop measures as it goes: read by its metrics rows, its epoch lines and the run's summary."""
    timer: metrics.StepTimer
    compile_clock: CompileClock  # torch.compile happens lazily, inside the first steps
    global_step: int
    first_step: int = -1  # the step this process started from (a resumed run starts past 0)
    t_start: float = 0.0
    total_time: float = 0.0
    first_step_done: float | None = None  # time.time() when the first optimizer step ended
    thread_pin: dict[str, Any] = field(default_factory=lambda: {"mode": None, "cpu": None, "reason": "no step ran"})
    window_compile: float = 0.0  # seconds spent compiling since the last metrics row
    window_losses: list[float] = field(default_factory=list)  # step losses since the last metrics row
    useful_per_step: list[float] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    last_eval: dict[str, float] = field(default_factory=dict)
    last_eval_step: int = -1  # an epoch-end eval right after a step's eval reuses it

    def __post_init__(self) -> None:
        self.first_step = self.global_step

    def add_step(self, loss: float, useful_tokens: float) -> None:
        self.global_step += 1
        self.useful_per_step.append(useful_tokens)
        self.window_losses.append(loss)


@dataclass
class EpochRecord:
    """One epoch's clock, its step losses and where a resume after its last step goes on."""
    t0: float
    compile0: float
    losses: list[float] = field(default_factory=list)
    next: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    step_losses: list[float] = field(default_factory=list)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _reduce_step(loss: torch.Tensor, useful_tokens: int, env: DistEnv, stop: bool = False, save: bool = False) -> tuple[float, float, bool, bool]:
    """This step's loss (each rank passes its share of the token-weighted mean: their sum is the mean), its non-pad
    tokens summed over ranks, and whether any rank was asked to stop / to checkpoint (preemption.py), in the same
    all-reduce.

    One process needs no collective and no host-to-device copy: one `.item()` is the only sync.
    """
    if not env.is_distributed:
        return loss.item(), float(useful_tokens), stop, save
    extra = torch.tensor([float(useful_tokens), float(stop), float(save)], device=loss.device)
    values = torch.cat([loss.float().reshape(1), extra])
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    total_loss, total_useful, stops, saves = values.tolist()
    return total_loss, total_useful, stops > 0, saves > 0


class Trainer:
    def __init__(self, run: ResolvedRun | RunConfig, plan: dict[str, Any] | None = None):
        """``run``: as the launcher resolved it (runtime/resolved.py); a bare config (a library call, a test) is resolved here."""
        run = run if isinstance(run, ResolvedRun) else resolve_run(run)
        cfg = self.cfg = run.cfg
        self.startup = StartupClock()
        self.plan = plan  # the launcher's memory prediction (run_plan.py), written into summary.json as-is
        self.device_type, self.precision = run.device_type, run.precision
        self.env = init_distributed(self.device_type, cfg.dist_timeout_s)
        if self.env.world_size != run.world:  # a launcher that started another world than the one resolved: a bug
            raise RuntimeError(f"resolved for a world of {run.world}, started in one of {self.env.world_size}")
        # Ranks that see different data: all of them, except pipeline stages, which share theirs.
        self.parallel = run.layout
        self.dp_size, self.dp_rank = self.parallel.dp_size, self.parallel.dp_rank(self.env.rank)
        self.micro, self.accum, self.global_batch = run.micro, run.accum, run.global_batch
        self.run_dir = Path(cfg.output_dir)
        self.step_losses: list[float] = []
        self.layout = reshard.layout(run)
        self.signals = StopSignals()
        self.config_text: str | None = None
        self.evals = EvalTracker(cfg.early_stopping_patience)  # initial, best and early stopping (restored on resume)
        self.pinned_released: dict[str, float] = {}  # GiB of cached pinned host memory given back, by moment
        self.warm_8bit: dict[str, Any] | None = None  # loop/warm_8bit.py: what compiling the 8-bit step beforehand did
        self.adapter: dict[str, Any] | None = None  # --peft: the adapters' settings and parameter counts (adapters.summary)

    # ---- setup ------------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            resolved = self.cfg.model_copy(update={"micro_batch": self.micro, "grad_accum": self.accum, "global_batch": self.global_batch})
            self.config_text = dump_config(resolved)  # also copied into every checkpoint
            (self.run_dir / "config.yaml").write_text(self.config_text)
            (self.run_dir / "env.json").write_text(json.dumps(environment_info(self.env, self.precision), indent=1))
        self.env.barrier()

    def _build_data(self, stage_dataset, tokenizer, model_vocab: int | None):
        # Rank 0 tokenizes and fills the cache; the others then read it (no N-fold tokenization race). Every rank passes
        # the same vocabularies, so that all compute the cache key rank 0 wrote.
        failure: UserError | None = None

        def build():
            return build_datasets(stage_dataset, tokenizer, self.cfg.seq_len, self.cfg.seed, model_vocab=model_vocab,
                                  token_vocab=synthetic_vocab(self.cfg, model_vocab) if tokenizer is None else None)

        if self.env.is_main:
            try:
                splits = build()
            except UserError as err:
                failure = err
        if self.env.is_distributed:  # tell the others, instead of leaving them to crash in a barrier
            ok = torch.tensor([0 if failure else 1], device=self.env.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not self.env.is_main and not ok.item():
                raise UserError("rank 0 could not build the training data", "see rank 0's error")
        if failure is not None:
            raise failure
        if not self.env.is_main:
            splits = build()
        return splits

    def _loaders(self, splits) -> tuple[DataLoader, SeekableDistributedSampler, DataLoader | None]:
        # Seekable: a resumed epoch starts at its checkpointed sample instead of collating every earlier batch to discard it.
        sampler = SeekableDistributedSampler(splits.train, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=True,
                                             seed=self.cfg.seed, drop_last=True)
        pin = self.device_type == "cuda"
        # Own generators: iter() then draws no number from the global RNG, whose state checkpoints restore
        # (an epoch-end eval after a checkpoint would otherwise shift every later dropout mask).
        generator = torch.Generator().manual_seed(self.cfg.seed)
        train = DataLoader(splits.train, batch_size=self.micro, sampler=sampler, drop_last=True, pin_memory=pin, generator=generator)
        evl = None
        if splits.eval is not None and len(splits.eval) > 0:
            es = DistributedSampler(splits.eval, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=False, drop_last=False)
            strategy_spec = spec(self.cfg.strategy)
            eval_batch = strategy_spec.eval_batch(self.micro, self.accum)  # what the planner's eval moment counts
            evl = DataLoader(splits.eval, batch_size=eval_batch, sampler=es, pin_memory=pin, drop_last=strategy_spec.eval_whole_steps,
                             generator=torch.Generator().manual_seed(self.cfg.seed))  # fmt: skip
            if len(evl) == 0:
                log0(self.env, f"no eval: {len(splits.eval)} eval samples per rank are fewer than one eval batch of {eval_batch} "
                               "(raise dataset.eval_samples / --eval-split)")
                evl = None
        return train, sampler, evl

    def _steps_per_epoch(self, train_loader: DataLoader) -> int:
        return len(train_loader) // self.accum

    def _stage_steps(self, stage, steps_per_epoch: int) -> int:
        if steps_per_epoch == 0:
            raise UserError(
                f"the training data has fewer blocks than one global batch ({self.global_batch} x {self.cfg.seq_len} tokens)",
                "use more data (--num-samples), a shorter --seq-len or a smaller batch",
            )
        if stage.epochs is not None:
            steps = math.ceil(stage.epochs * steps_per_epoch)
            if stage.max_steps:
                steps = min(steps, stage.max_steps)
        else:
            steps = stage.max_steps or steps_per_epoch
        return int(steps)

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Data, model and engine, resume, the loop, export: the whole run on this rank."""
        cfg, env = self.cfg, self.env
        self.startup.mark("launch_and_imports")
        seed_everything(cfg.seed)
        # Data first: a missing/empty/malformed dataset is a UserError that must not leave a half-written run dir.
        tokenizer, stages, stage_data, stage_loaders, stage_steps = self._data()
        total_steps = sum(stage_steps)
        seed_everything(cfg.seed)  # identical initial weights whatever the data pipeline consumed
        strategy, model, info, samples_before = self._model(tokenizer, total_steps)
        state = self._resume_state(strategy)
        faults.arm(model, env.rank, state["global_step"], self.accum)  # tests only (SHARDLAB_FAULTS)
        writer = self._writer(state)
        self.signals.install()  # SIGTERM/SIGUSR1: checkpoint and stop after this step; SIGUSR2: checkpoint; SIGINT: stop
        try:
            summary = self._loop(strategy, stages, stage_data, stage_loaders, stage_steps, total_steps, state, writer, info)
            if self.plan is not None:
                summary["plan"] = self.plan
            if cfg.export:
                summary["exported_step"] = self._restore_best(strategy, summary["steps"]) if cfg.save_best else summary["steps"]
                path = checkpoint.export_hf(strategy, tokenizer, self.run_dir)
                if path:
                    log0(env, f"exported HF model to {path}" + (" (no tokenizer files: this run had no tokenizer)" if tokenizer is None else ""))
                    summary["export_dir"] = str(path)
        finally:
            self.signals.uninstall()
            writer.close()
        if env.is_main:
            if samples_before is not None:
                self._write_samples(samples_before, summary)
            summary.update(compat.summary())  # the patches of dependencies' internals this run applied (compat/)
            RunSummary.from_dict(summary).write(self.run_dir)  # the launcher adds the monitor's figures (summary.merge_monitor)
        return RunResult(self.run_dir, summary, self.step_losses)

    def _data(self) -> tuple[Any, list, list, list, list[int]]:
        """The run's tokenizer, stages, their data and loaders, and each stage's optimizer steps; the run directory made once
        they are known to be good."""
        cfg, env = self.cfg, self.env
        tokenizer = run_tokenizer(cfg)  # None: synthetic data only, and the preset's tokenizer is not installed here
        model_vocab = getattr(build_hf_config(cfg), "vocab_size", None)
        if tokenizer is None:
            log0(env, f"no tokenizer: {offline_tokenizer_problem(cfg).message}; synthetic token ids need only the vocabulary "
                      f"size ({synthetic_vocab(cfg, model_vocab)} ids)" + ("; the export writes the model without tokenizer files"
                      if cfg.export else "") + ("; no samples (--samples needs the tokenizer)" if cfg.samples else ""))
        stages = cfg.stages()
        stage_data = [self._build_data(st.dataset, tokenizer, model_vocab) for st in stages]
        stage_loaders = [self._loaders(sp) for sp in stage_data]
        if self.plan is not None and self.env.rank == 0 and stage_data[0].eval is not None and len(stage_data[0].eval):
            # the launcher planned a full eval batch per rank: re-planned with the eval split's size (its forward can be
            # the run's peak)
            from ..planning.run_plan import with_eval_split

            self.plan = with_eval_split(self.plan, cfg, max(1, env.world_size // cfg.nodes), len(stage_data[0].eval))
        self.startup.mark("data")
        stage_steps = [self._stage_steps(st, self._steps_per_epoch(ld[0])) for st, ld in zip(stages, stage_loaders)]
        if cfg.curriculum and cfg.max_steps:  # a top-level --max-steps caps the whole curriculum
            stage_steps = _cap(stage_steps, cfg.max_steps)
        if (cfg.early_stopping_patience or cfg.save_best) and any(loaders[2] is None for loaders in stage_loaders):
            raise UserError("--early-stopping-patience and --save-best compare eval losses, and this run has no eval split",
                            "set --eval-split (e.g. 0.05), or use a dataset with an eval split")
        self._prepare_run_dir()
        log0(env, f"world {env.world_size} x {env.device.type} ({env.backend}), strategy {cfg.strategy}, precision {self.precision.name}, "
                  f"micro {self.micro} x accum {self.accum} x data-parallel {self.dp_size} = global batch {self.global_batch}, seq {cfg.seq_len}")
        for st, sp, n in zip(stages, stage_data, stage_steps):
            log0(env, f"stage {st.name or 'train'}: {sp.stats.get('source')} | {sp.stats.get('train_blocks')} train blocks, "
                      f"{sp.stats.get('eval_blocks')} eval blocks, non-pad {sp.stats.get('non_pad_fraction', 1.0):.1%} | {n} optimizer steps")
            dup = sp.stats.get("duplicates_dropped") or {}
            if dup.get("exact") or dup.get("near"):
                log0(env, f"stage {st.name or 'train'}: dropped {dup['exact'] + dup['near']} duplicate record(s) before holding out "
                          f"the eval split ({dup['exact']} exact, {dup['near']} the same text once case, punctuation and "
                          "whitespace are normalised), so that no eval record is a training record")
            if sp.stats.get("misplaced_answers"):
                log0(env, f"stage {st.name or 'train'}: skipped {sp.stats['misplaced_answers']} QA example(s) whose answer is not at its "
                          "answer_start in the context (outside it, or other text there)")

        return tokenizer, stages, stage_data, stage_loaders, stage_steps

    def _model(self, tokenizer, total_steps: int) -> tuple[Any, nn.Module, dict[str, Any], Any]:
        """The strategy, the model it built (with adapters under --peft) and set up, the model's facts for the summary, and
        the samples before training (--samples)."""
        cfg, env = self.cfg, self.env
        strategy = strategy_class(cfg.strategy)(cfg, env, self.precision, self.accum, self.micro)
        model = strategy.build_model()  # only what the engine keeps: its dtype, ZeRO-3 partitions, FSDP shards
        apply_dropout(model, cfg.dropout)
        if strategy.spec.engine != "pipelining":  # a pipeline's head is in its last stage's module
            padded = head_padding.apply(model, cfg, env.device.type, strategy.loss_kernel)
            if padded:
                log0(env, padded)
        samples_before = self._samples(model, tokenizer) if cfg.samples and tokenizer is not None and env.is_main else None  # the model as loaded (or why not)
        info = model_summary(model)
        info.update(mfu.model_flops(model, cfg.seq_len))  # FLOPs per token, for the MFU in the summary
        log0(env, f"model {cfg.model}: {info.get('human', info)}; weights: {describe_weights(cfg)}")
        if cfg.peft.method:  # on the model as built, before the engine wraps it: the engine then sees the frozen weights
            model = adapters.apply(model, cfg)
            self.adapter = adapters.summary(model, cfg)
            log0(env, adapters.describe(self.adapter))
            info.update(mfu.model_flops(model, cfg.seq_len))  # the frozen base has no weight gradients: 4, not 6
            log0(env, f"MFU counts {info['flops_per_token']:,} FLOPs per token: {info['flops_counted']}")
        self.startup.mark("model_build")
        strategy.setup(model, total_steps)
        self._release_pinned("engine set-up")  # what set-up pinned and freed (training/pinned.py)
        self.startup.mark("engine_setup")
        if env.device.type == "cuda" and cfg.optimizer == "adamw8bit":
            self._warm_8bit(strategy)
        log0(env, f"{strategy.memory_note()}; optimizer: {optim.arithmetic(cfg)}")

        return strategy, model, info, samples_before

    def _resume_state(self, strategy) -> dict[str, Any]:
        """Where the loop starts: a checkpoint's position under --resume, else the beginning."""
        cfg, env = self.cfg, self.env
        state = {"global_step": 0, "stage": 0, "epoch": 0, "step_in_epoch": 0}
        if cfg.resume:
            resume_dir = checkpoint.find_resume_dir(cfg.resume, self.run_dir)
            if resume_dir is not None:
                state = checkpoint.load(strategy, resume_dir, self.layout)
                self.evals = EvalTracker.restore(cfg.early_stopping_patience, state.get("evals"))
                log0(env, f"resumed from {resume_dir} at step {state['global_step']}")
            else:
                log0(env, "no checkpoint to resume from; starting fresh")

        return state

    def _writer(self, state: dict[str, Any]) -> metrics.MetricsWriter:
        """metrics.jsonl (and TensorBoard, wandb), appended to after a resume from its last kept step."""
        cfg, env = self.cfg, self.env
        wandb_run = None
        if cfg.wandb and env.is_main:
            try:
                import wandb

                wandb_run = wandb.init(project=cfg.wandb_project, config=cfg.model_dump(mode="json"), dir=str(self.run_dir))
            except ImportError:
                log0(env, "wandb is not installed; `pip install wandb` to enable it (continuing without)")
        if env.is_main and state["global_step"] > 0:
            metrics.drop_rows_after(self.run_dir / "metrics.jsonl", state["global_step"])
        writer = metrics.MetricsWriter(self.run_dir, env.is_main, cfg.tensorboard, wandb_run, append=state["global_step"] > 0)
        return writer

    def oom_error(self) -> OutOfMemory:
        env, cfg = self.env, self.cfg
        peak = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else float("nan")
        return OutOfMemory(
            f"CUDA out of memory with strategy {cfg.strategy} at micro batch {self.micro} (peak allocated {peak:.1f} GiB on rank {env.rank})",
            f"try --micro-batch {max(1, self.micro // 2)} with --grad-accum {self.accum * 2}, --gradient-checkpointing, "
            f"or a strategy that shards more ({next_strategy(cfg.strategy)})",
        )

    # ---- evaluations: the initial one, the best one, early stopping, samples -------------------------
    def _track(self, strategy, ev: dict[str, float], position: dict[str, Any]) -> None:
        """Feed an evaluation made after a training step (at `position`, a checkpoint's trainer state) to the tracker;
        with --save-best a new best is checkpointed into checkpoints/best. Collective (every rank has the same loss)."""
        if "eval_loss" not in ev:
            return
        step = position["global_step"]
        if self.evals.update(step, ev["eval_loss"]) and self.cfg.save_best:
            checkpoint.save(strategy, self.run_dir, {**position, "evals": self.evals.state()}, self.cfg.keep_checkpoints,
                            self.config_text, name=checkpoint.BEST)
        if self.evals.stopped_early:
            log0(self.env, f"early stopping at step {step}: {self.evals.since_best} evaluations without an eval loss below "
                           f"{self.evals.best:.4f} (step {self.evals.best_step})")

    def _restore_best(self, strategy, current: int) -> int:
        """--save-best: load the best checkpoint into the strategy, for the export; returns the step exported. Collective."""
        best = self.evals.best_step
        directory = checkpoint.checkpoints_root(self.run_dir) / checkpoint.BEST
        if best is None or best == current:
            return current
        found = checkpoint.complete(directory)  # best/, or best.old if a kill came while best/ was re-saved
        if found is None:  # e.g. resumed with --save-best from a run that had it off
            log0(self.env, f"no best checkpoint in {directory}; exporting the last step {current}")
            return current
        checkpoint.load(strategy, found, self.layout)
        log0(self.env, f"exporting the best step {best} (eval loss {self.evals.best:.4f}), not the last step {current}")
        return best

    def _samples(self, model, tokenizer) -> list[str] | str:
        """Greedy completions of the sample prompts by `model`, on the CPU where it was built; or, for a model built
        as shards only (FSDP2 on the meta device, ZeRO-3 partitions), the reason there are none."""
        if any(p.is_meta or hasattr(p, "ds_id") for p in model.parameters()):
            return "the model was built on the meta device for the engine to materialise (its shards, or on the GPU), so no rank holds it whole on the CPU before training"
        return complete_all(model, tokenizer, self.cfg.sample_prompts or SAMPLE_PROMPTS)

    def _write_samples(self, before: list[str] | str, summary: dict[str, Any]) -> None:
        """samples.md: the completions before training and those of the exported model (rank 0)."""
        prompts = self.cfg.sample_prompts or SAMPLE_PROMPTS
        after, label = None, "no exported model: the run had --no-export"
        if summary.get("export_dir"):
            model, tokenizer, _ = load(summary["export_dir"])
            after = self._samples(model, tokenizer)
            label = f"the exported model, step {summary['exported_step']}"
        (self.run_dir / SAMPLES_FILE).write_text(samples_markdown(self.cfg.model, prompts, before, after, label))

    def _train_step(self, strategy, batches: DevicePrefetcher) -> tuple[float, float, float, float | None, bool, bool]:
        """One optimizer step over `grad_accum` micro-batches: (loss: the mean over the step's label tokens on every
        rank, non-pad tokens, the learning rate the step used, grad norm, stop requested on some rank, checkpoint
        requested on some rank)."""
        lr = strategy.current_lr()  # before the step: the scheduler moves on inside optimizer_step
        step_loss, useful = strategy.train_step(batches)
        with strategy.time_split.optimizer():  # offload runs: CPU optimizer time (timesplit.py); else a no-op
            grad_norm = strategy.optimizer_step()
        stop, save = self.signals.stop_signal is not None, self.signals.take_save_request()
        loss_value, useful_total, stop, save = _reduce_step(step_loss, useful, self.env, stop, save)
        return loss_value, useful_total, lr, grad_norm, stop, save

    def _guard_nonfinite(self, strategy, step: int, loss: float, grad_norm: float | None) -> None:
        """nan_policy: 'stop' raises naming the step; 'skip' goes on (the strategy did not apply the update)."""
        bad_grad = grad_norm is not None and not math.isfinite(grad_norm) and strategy.precision.name != "fp16"
        if math.isfinite(loss) and not bad_grad and not (strategy.last_step_skipped and strategy.precision.name != "fp16"):
            return
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
        if self.cfg.nan_policy == "stop":
            raise UserError(f"non-finite {what} at step {step}", "lower --lr, use bf16 instead of fp16, check the data, or pass --nan-policy skip")
        if strategy.last_step_skipped:
            log0(self.env, f"step {step}: non-finite {what}; update skipped (nan_policy skip, {strategy.skipped_steps} skipped so far)")
        else:  # e.g. a batch without a single supervised token: 0/0 loss, zero gradients
            log0(self.env, f"step {step}: non-finite {what} but finite gradients; update applied")

    def _warm_8bit(self, strategy) -> None:
        """torchao's 8-bit step compiled and autotuned before training (loop/warm_8bit.py: why)."""
        try:
            self.warm_8bit = warm_8bit.warm(strategy.optimizer, self.cfg)
        except torch.OutOfMemoryError as e:  # the first step autotunes instead, as without the warm-up
            torch.cuda.empty_cache()
            self.warm_8bit = {"skipped": f"CUDA out of memory: {str(e).splitlines()[0]}"}
            log0(self.env, "could not compile the 8-bit step before training (CUDA out of memory); the first step compiles it")
        self._release_pinned("the 8-bit step's warm-up")
        self.startup.mark("optimizer_compile")
        if "seconds" in self.warm_8bit:
            log0(self.env, f"compiled torchao's 8-bit step for {self.warm_8bit['graphs']} parameter shapes in "
                           f"{self.warm_8bit['seconds']:.1f} s before training (inductor's autotuner cloned on the GPU)")

    def _release_pinned(self, after: str) -> None:
        """Give back the pinned host blocks that ``after`` freed and torch's allocator keeps cached; summary.json's
        pinned_released_gib says how much (training/pinned.py)."""
        released = pinned.release_cached(self.env.device.type)
        self.pinned_released[after] = round(released, 3)
        if released >= 0.5:
            log0(self.env, f"released {released:.1f} GiB of cached pinned host memory that {after} freed")

    def _pin_thread(self, strategy) -> dict[str, Any]:
        """After the first step: pin this rank's training thread and autograd's device threads to one CPU of the rank's
        cores where cfg.pin_thread says so (runtime/pin.py: why, and what keeps the full set). What was done, for
        summary.json's thread_pin."""
        cfg, env = self.cfg, self.env
        cores = strategy.bound_cores or None  # a rank bound to its share already: the pin stays inside it
        cpu, reason = pin.pin_decision(cfg, env.device.type, 0 if cores else env.local_rank,
                                       1 if cores else local_world_size(), cores)
        out: dict[str, Any] = {"mode": cfg.pin_thread, "cpu": cpu, "reason": reason}
        if cpu is not None:
            try:
                out.update(pin.pin(cpu))
            except OSError as e:  # a mask this process may not set (a container's cpuset): train unpinned
                out.update(cpu=None, reason=f"sched_setaffinity failed: {e}")
        if env.is_main and out["cpu"] is not None:
            messages.info(f"pinned the training thread and {out['threads'] - 1} autograd thread(s) to CPU {cpu} "
                          f"({reason}; threads and processes started later get all {out['full_set']} CPUs)")
        return out

    def _loop(self, strategy, stages, stage_data, stage_loaders, stage_steps, total_steps, state, writer, model_info) -> dict[str, Any]:
        cfg, env = self.cfg, self.env
        rec = LoopRecord(metrics.StepTimer(env.device), CompileClock(), state["global_step"])
        rec.thread_pin["mode"] = cfg.pin_thread
        profiler = StepProfiler(self.run_dir, env.rank, env.device, cfg.profile)
        if rec.global_step == 0 and cfg.eval_at_start and stage_loaders[0][2] is not None:
            initial = evaluate(strategy, stage_loaders[0][2], env)  # the baseline; not a candidate for the best step
            self.evals.initial = initial.get("eval_loss")
            writer.log({"step": 0, **initial})
            self.startup.mark("initial_eval")
        rec.t_start = time.perf_counter()
        progress = progress_bar(env, total_steps, rec.global_step)
        strategy.train()
        for si in range(state["stage"], len(stages)):
            train_loader, sampler, eval_loader = stage_loaders[si]
            steps_per_epoch = self._steps_per_epoch(train_loader)
            stage_end = sum(stage_steps[: si + 1])
            first_epoch = state["epoch"] if si == state["stage"] else 0
            for epoch in range(first_epoch, math.ceil(stage_steps[si] / steps_per_epoch)):
                if rec.global_step >= stage_end:
                    break
                sampler.set_epoch(epoch)
                skip = state["step_in_epoch"] if (si == state["stage"] and epoch == state["epoch"]) else 0
                # Seek to where the checkpoint stopped: the same remaining batches, without fetching the skipped ones.
                # Still one iter() per epoch, so the loader's generator is drawn from exactly as before.
                sampler.skip_next(skip * self.accum * self.micro)
                batches = DevicePrefetcher(iter(train_loader), env.device, self.accum)
                ep = EpochRecord(time.perf_counter(), rec.compile_clock.seconds())
                for step_in_epoch in range(skip, steps_per_epoch):
                    if rec.global_step >= stage_end:
                        break
                    compiled_before = rec.compile_clock.seconds()
                    rec.timer.start()
                    loss_value, useful_total, lr, grad_norm, stop, save_now = self._train_step(strategy, batches)
                    profiler.step(rec.timer.stop())
                    if rec.first_step_done is None:
                        self._after_first_step(strategy, rec)
                    rec.window_compile += rec.compile_clock.seconds() - compiled_before
                    rec.add_step(loss_value, useful_total)
                    ep.losses.append(loss_value)
                    self.step_losses.append(loss_value)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                    if rec.global_step % cfg.log_every == 0 or rec.global_step == total_steps:
                        self._log_row(strategy, rec, writer, total_steps, si, epoch + (step_in_epoch + 1) / steps_per_epoch, lr, grad_norm)
                    self._guard_nonfinite(strategy, rec.global_step, loss_value, grad_norm)  # after the row: it shows the step
                    done_epoch = step_in_epoch + 1 == steps_per_epoch
                    ep.next = {"global_step": rec.global_step, "stage": si, "epoch": epoch + 1 if done_epoch else epoch,
                               "step_in_epoch": 0 if done_epoch else step_in_epoch + 1, "layout": self.layout}  # where a resume goes on
                    self._after_step(strategy, rec, writer, eval_loader, ep.next, stop, save_now, done_epoch)
                    if self.evals.stopped_early:
                        break
                self._end_epoch(strategy, rec, writer, eval_loader, ep, si, epoch)
                if self.evals.stopped_early:
                    break
            if self.evals.stopped_early:
                break
        profiler.close()
        if progress is not None:
            progress.close()
        rec.total_time = time.perf_counter() - rec.t_start
        if rec.thread_pin.get("cpu") is not None:
            pin.release()  # export, generate and the summary's collectives run with the full set again
        return self._summary(strategy, rec, stage_data, stage_loaders, model_info)

    def _after_first_step(self, strategy, rec: LoopRecord) -> None:
        """Start-up ends at the first optimizer step: say how long it took, pin the training thread, give back the
        pinned memory a first-step autotune took."""
        rec.first_step_done = time.time()
        self.startup.mark("first_step")
        rec.thread_pin = self._pin_thread(strategy)
        if pinned.autotuned_in_first_step(self.cfg.optimizer):  # inductor's pinned copies (pinned.py)
            self._release_pinned("the first step")
        compiled = rec.compile_clock.seconds()
        log0(self.env, self.startup.line() + (f" (compiling {compiled:.1f} s of it)" if compiled else ""))

    def _log_row(self, strategy, rec: LoopRecord, writer, total_steps: int, stage: int, epoch: float, lr: float,
                 grad_norm: float | None) -> None:
        """One metrics row: the steps since the last row, the last step's speed and the memory now."""
        t = rec.timer.times[-1]
        row = {"step": rec.global_step, "stage": stage, "epoch": epoch, "loss": statistics.fmean(rec.window_losses), "lr": lr,
               "grad_norm": grad_norm, "step_time_s": t, "tokens_per_s": self.global_batch * self.cfg.seq_len / t,
               "useful_tokens_per_s": rec.useful_per_step[-1] / t, "samples_per_s": self.global_batch / t}
        if rec.window_compile:  # seconds of the steps since the last row spent compiling
            row["compile_time_s"], rec.window_compile = rec.window_compile, 0.0
        if strategy.skipped_steps:
            row["skipped_steps"] = strategy.skipped_steps  # so far: non-finite or fp16-overflow steps
        row.update(metrics.memory_snapshot(self.env.device))
        writer.log(row)
        if self.env.is_main and not sys.stdout.isatty():  # a log file (SLURM, nohup, `> log`) gets plain lines, no bar
            elapsed = time.perf_counter() - rec.t_start  # this process's steps only (a resumed run restarts the clock)
            eta = elapsed / (rec.global_step - rec.first_step) * (total_steps - rec.global_step)
            messages.info(progress_line(row, total_steps, eta).removeprefix("[shardlab] "))
        rec.window_losses.clear()

    def _after_step(self, strategy, rec: LoopRecord, writer, eval_loader, nxt: dict[str, Any], stop: bool, save_now: bool,
                    done_epoch: bool) -> None:
        """The eval, checkpoint and stop a step may call for; ``nxt``: where a resume goes on."""
        cfg, step = self.cfg, rec.global_step
        if cfg.eval_every and step % cfg.eval_every == 0 and eval_loader is not None:
            rec.last_eval, rec.last_eval_step = evaluate(strategy, eval_loader, self.env), step
            writer.log({"step": step, **rec.last_eval})
            self._track(strategy, rec.last_eval, nxt)
        saved = None  # a stop by SIGTERM/SIGUSR1 asks for a checkpoint (save_now); by SIGINT, only if the run saves them
        if save_now or (stop and cfg.save_every) or (cfg.save_every and step % cfg.save_every == 0) or (cfg.save_each_epoch and done_epoch):
            saved = checkpoint.save(strategy, self.run_dir, {**nxt, "evals": self.evals.state()}, cfg.keep_checkpoints, self.config_text)
        if stop:
            raise Preempted(self.signals.describe(), step, str(saved) if saved else None, requeue=save_now)

    def _end_epoch(self, strategy, rec: LoopRecord, writer, eval_loader, ep: EpochRecord, stage: int, epoch: int) -> None:
        """An epoch's eval (unless its last step just had one) and its line in metrics.jsonl and the summary."""
        wall = time.perf_counter() - ep.t0
        compiled = rec.compile_clock.seconds() - ep.compile0
        epoch_time = wall - compiled  # the epoch's time as a compiled run repeats it
        ev = {}
        if eval_loader is not None and rec.last_eval_step == rec.global_step:  # evaluated after this very step
            ev = rec.last_eval
        elif eval_loader is not None:
            ev, rec.last_eval_step = evaluate(strategy, eval_loader, self.env), rec.global_step
            self._track(strategy, ev, ep.next)
        rec.last_eval = ev or rec.last_eval
        if ep.losses:
            steps = len(ep.losses)
            summary = {"stage": stage, "epoch": epoch, "steps": steps, "train_loss": statistics.fmean(ep.losses), **ev,
                       "epoch_time_s": epoch_time, "epoch_wall_time_s": wall, "compile_time_s": compiled,
                       "samples_per_s": steps * self.global_batch / epoch_time, "steps_per_s": steps / epoch_time, **metrics.peak_memory(self.env)}
            rec.epochs.append(summary)
            writer.log({"step": rec.global_step, "epoch_summary": summary})

    def _summary(self, strategy, rec: LoopRecord, stage_data, stage_loaders, model_info) -> dict[str, Any]:
        """The run's summary.json (measure/summary.RunSummary reads it back), printed on rank 0."""
        cfg, env = self.cfg, self.env
        tokens_per_step = self.global_batch * cfg.seq_len
        steady = rec.timer.steady()
        mean_useful = statistics.fmean(rec.useful_per_step[-len(steady):]) if steady else 0.0
        summary: dict[str, Any] = {
            "model": cfg.model, "strategy": cfg.strategy, "precision": self.precision.name, "device_type": env.device.type,
            "world_size": env.world_size, "micro_batch": self.micro, "grad_accum": self.accum, "global_batch": self.global_batch,
            "seq_len": cfg.seq_len, "steps": rec.global_step, "tokens_per_step": tokens_per_step,
            "n_params": model_info.get("n_params"), "param_bytes": model_info.get("param_bytes"), "adapter": self.adapter,
            "final_train_loss": self.step_losses[-1] if self.step_losses else None,
            "final_eval_loss": rec.last_eval.get("eval_loss"), "final_eval_ppl": rec.last_eval.get("eval_ppl"),
            "non_pad_fraction": stage_data[-1].stats.get("non_pad_fraction"),
            "warmup_steps_excluded": min(metrics.WARMUP_STEPS, max(0, len(rec.timer.times) - len(steady))),
            "total_time_s": rec.total_time, "compile": cfg.compile,
            "compile_scope": compiling.scope(cfg, strategy.hf_model) if cfg.compile else None,
            "compile_mode": cfg.compile_mode if cfg.compile else None, "sdpa_backend": cfg.sdpa_backend,
            # wall time from the command's start (imports, data, model, engine set-up) to the first optimizer step done
            "time_to_first_step_s": rec.first_step_done - process_start_time() if rec.first_step_done is not None else None,
            "startup_s": self.startup.phases() or None,  # measure/startup.py: where that time went
            **rec.compile_clock.summary(),
            "loss_kernel": strategy.loss_kernel, "gradient_checkpointing": cfg.gradient_checkpointing,
            "skipped_steps": strategy.skipped_steps, "overflow_steps": strategy.overflow_steps,
            **metrics.throughput(steady, tokens_per_step, mean_useful, self.global_batch), **metrics.peak_memory(env),
            **self.evals.summary(),
            "epochs": rec.epochs,
            **strategy.summary_extras(),
            "thread_pin": rec.thread_pin,
            "pinned_released_gib": dict(self.pinned_released) or None,
            "eight_bit_warmup": self.warm_8bit,
        }
        summary.update(metrics.run_stats(summary, model_info, env, self._steps_per_epoch(stage_loaders[-1][0])))
        if env.is_main and messages.shows("info"):  # --quiet: not the table either
            print_summary(summary)
        return summary


def _cap(steps: list[int], limit: int) -> list[int]:
    """Cut a list of per-stage step counts so that their sum is at most `limit`."""
    out = []
    for n in steps:
        out.append(min(n, limit))
        limit -= out[-1]
    return out


def next_strategy(name: str) -> str:
    """What an out-of-memory run of `name` should try next (its spec's oom_next)."""
    found = lookup(name)
    return found.oom_next if found is not None else StrategySpec.oom_next


def run_worker(run: ResolvedRun | RunConfig, plan: dict[str, Any] | None = None) -> RunResult:
    """Entry point of one worker process (also the whole run when there is one process). ``run``: as the launcher
    resolved it; a bare config (a library call, a test) is resolved here, once."""
    run = run if isinstance(run, ResolvedRun) else resolve_run(run)
    cfg = run.cfg
    # A rank killed by a native fault (SIGSEGV, SIGABRT from a C++ terminate) prints its Python stacks
    # first, so "rank 1 was killed by SIGABRT" comes with where it was.
    faulthandler.enable(all_threads=True)
    use_persistent_cache(cfg.sdpa_backend)  # before anything compiles
    compat.start_run()  # summary.json's patches are this run's
    try:
        # why: its docstring (faster CPU steps, a higher resident peak: only where the plan says the run fits with it)
        with reuse_freed_heap(heap_reuse(cfg, run.device_type, plan)):
            trainer = Trainer(run, plan)
            try:
                return trainer.run()
            except torch.OutOfMemoryError:  # model placement, engine setup, the loop or the export
                raise trainer.oom_error() from None
            except Exception as err:  # another rank died or hung: one line, naming it where known (guards.py)
                if trainer.env.is_distributed and guards.is_comm_failure(err):
                    mark_group_broken()
                    raise guards.comm_failure(err, trainer.env.rank, cfg.dist_timeout_s) from None
                raise
    finally:
        shutdown_distributed()
        compat.restore_all()  # the dependencies' own code again for whatever this process runs next
