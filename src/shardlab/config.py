"""RunConfig: one validated description of a run, from YAML plus CLI overrides.

Every other module reads its settings from here. Unknown keys and wrong types are
errors (pydantic ``extra="forbid"``, strict scalars), reported as one line by
``load_config``. The batch triple (micro, accumulation, global) is resolved
against the data-parallel world size by ``RunConfig.resolve_batch``, the single
source of truth for it.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .dotted import set_dotted
from .errors import UserError

from .specs.registry import DEFAULT_STRATEGY, names, spec
from .layout import data_parallel_size, pipeline_stages

# Every strategy name, in the registry's order (specs/): the choices listed by --help and errors.
STRATEGIES = names()


def cli(flag: str, also: dict[str, str] | None = None) -> dict[str, Any]:
    """A field's `shardlab train` flag (``json_schema_extra``): the CLI builds its flags from these and the fields'
    descriptions (cli.FLAGS), so a setting's name, type, default and help live here once. ``also``: further flags
    that set the same key, each with its own help (``--microbatches`` is ``grad_accum`` in pipeline words)."""
    return {"cli": {"flag": flag, "also": dict(also or {})}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class DatasetConfig(_Strict):
    """Where examples come from and how they become token blocks."""

    source: str = Field("offline", json_schema_extra=cli("--dataset"),
        description="'offline' (CPython docs corpus), 'synthetic', a hub name (wikitext-2-raw-v1, squad, owner/name) or a "
        "local file/directory")
    format: Literal["lm", "qa"] = Field("lm", json_schema_extra=cli("--format"),
        description="lm (plain text) or qa (Question/Context/Answer)")
    num_samples: int | None = Field(None, gt=0, json_schema_extra=cli("--num-samples"),
        description="use only the first N training examples (default: all)")
    eval_split: float = Field(0.05, ge=0.0, lt=1.0, json_schema_extra=cli("--eval-split"),
        description="fraction held out for eval when the source has no eval split")
    eval_samples: int | None = Field(None, gt=0, description="cap on eval examples")
    packing: Literal["pack", "pad"] = Field("pack", json_schema_extra=cli("--packing"),
        description="'pack' concatenates into full seq_len blocks; 'pad' pads/truncates each example")
    answer_only_loss: bool = Field(False, json_schema_extra=cli("--answer-only-loss"),
        description="qa format: compute loss on answer tokens only")
    text_field: str | None = Field(None, description="column holding text (default: 'text')")
    hub_config: str | None = Field(None, description="hub dataset configuration name, e.g. wikitext-2-raw-v1")
    synthetic_tokens: int = Field(200_000, gt=0, description="synthetic source: number of random tokens")


# compat/zero3_one_rank.py's shortcuts, by the names a config gives them (that module installs them)
ZERO3_ONE_RANK_SHORTCUTS = ("keep_gathered", "identity_reduce_scatter")


class StrategyOptions(_Strict):
    """Knobs of the memory strategies; each is ignored by strategies it does not concern."""

    pin_memory: bool = Field(True, json_schema_extra=cli("--pin-memory"),
        description="page-locked CPU buffers for offload")
    nvme_path: str | None = Field(None, json_schema_extra=cli("--nvme-path"),
        description="infinity: swap directory on local NVMe (no default: infinity needs it)")
    nvme_min_free_gb: float = Field(0.0, ge=0.0, description="infinity: extra free space to demand beyond the estimate")
    overlap_comm: bool | None = Field(None, description="DeepSpeed overlap of gradient reduction with backward (default: on with >1 rank)")
    contiguous_gradients: bool | None = Field(
        None, description="DeepSpeed's contiguous gradient buckets (default: off for zero3 without offload, where the copy "
        "of every gradient into the bucket is device and host work that the reduce-scatter's own flattening copy repeats; "
        "on otherwise)")
    zero3_one_rank_shortcuts: list[Literal[ZERO3_ONE_RANK_SHORTCUTS]] | None = Field(
        None, description="ZeRO-3 on one rank without offload: skip the step's work that only moves data between the rank "
        "and itself (compat/zero3_one_rank.py: what each does). Default: both; [] runs DeepSpeed's own path")
    zero3_foreach_norm: bool = Field(
        True, description="ZeRO-3 without optimizer offload, any number of ranks: take the gradient norm with one "
        "multi-tensor kernel per dtype instead of one fp64 kernel per gradient tensor (compat/zero3_norm.py); false "
        "runs DeepSpeed's own")
    zero3_block_leaves: bool | None = Field(
        None, description="ZeRO-3: make the model's decoder-block class a DeepSpeed leaf module (one fetch/release hook pair "
        "and one gather per block instead of per sub-module: ~9x fewer coordinator calls). Default: on without offload "
        "(one rank or several), off with offload (not measured there)")
    # None: shardlab chooses (strategies/deepspeed_config.sized_buckets): DeepSpeed's own default, sized from the model's width
    # under offload, every parameter persistent for ZeRO-3 on one rank. "Not set" is the value None, not pydantic's record
    # of which fields were given, which a config.yaml written by one process and read by another (the launcher's
    # workers, SLURM jobs, a run's config.yaml given back to --config) does not carry.
    reduce_bucket_size: int | None = Field(None, gt=0, description="DeepSpeed gradient bucket (elements; default: "
        "DeepSpeed's 5e8, hidden^2 with offload)")
    allgather_bucket_size: int | None = Field(None, gt=0, description="DeepSpeed all-gather bucket (elements; default: "
        "DeepSpeed's 5e8, hidden^2 with offload)")
    stage3_prefetch_bucket_size: int | None = Field(None, gt=0, description="ZeRO-3 prefetch (elements; default: "
        "DeepSpeed's 5e7; with offload the larger of 5e7 and 0.9 hidden^2)")
    stage3_param_persistence_threshold: int | None = Field(None, ge=0, description="ZeRO-3: parameters up to this size "
        "stay whole on every rank (default: DeepSpeed's 1e5; with offload the larger of 1e5 and 10 hidden; "
        "every parameter on one rank without parameter offload)")
    stage3_max_live_parameters: int = Field(1_000_000_000, gt=0, description="ZeRO-3: the most parameters gathered at "
        "once before DeepSpeed releases some (DeepSpeed's default)")
    stage3_max_reuse_distance: int = Field(
        1_000_000_000, ge=0, description="ZeRO-3: a gathered parameter used again within this many parameters stays gathered "
        "(DeepSpeed's default; below the model's size it lowers the peak at the start of backward, at the cost of re-gathering)")
    fsdp_reshard_after_forward: bool | None = Field(
        None, description="fsdp, fsdp_offload: free each unit's gathered parameters after its forward and gather them again "
        "in backward (default: off on one rank without parameter offload, where it only adds a gather; on otherwise)")
    fsdp_units: Literal["auto", "blocks", "model"] = Field(
        "auto", description="fsdp, fsdp_offload: what each fully_shard unit is: 'blocks' (each transformer block, then the "
        "root), 'model' (the root alone: one gather and one reduction per step); auto: 'model' on one rank without "
        "parameter offload, where per-block units bound no memory and only add hooks and launches; 'blocks' otherwise")
    fsdp_blocks_per_unit: int | None = Field(
        None, ge=1, description="fsdp, fsdp_offload with block units: how many consecutive transformer blocks form one "
        "fully_shard unit (one gather, one reduction and one set of hooks for all of them); default: on several ranks "
        "without parameter offload, enough that a unit holds 4.5e11 parameters x micro-batch tokens (at most 4), else 1")
    fsdp_gather_after_step: bool | None = Field(
        None, description="fsdp, fsdp_offload: gather (unshard) the parameters for the next forward right after the "
        "optimizer step, while the GPU still runs it, instead of at the start of the next forward, where the GPU waits "
        "for the host; default: on where the gathered parameters stay alive from forward to backward anyway (not "
        "resharding after forward, no parameter offload), off otherwise")
    fsdp_prefetch: int | None = Field(
        None, ge=0, description="fsdp on several ranks with block units: how many blocks ahead each block's forward and "
        "backward issue their all-gathers (FSDP2's set_modules_to_forward/backward_prefetch); 0 or unset: FSDP2's "
        "implicit prefetch (the next unit's gather is issued when the host reaches it)")
    offload_ratio: float = Field(1.0, gt=0.0, le=1.0, json_schema_extra=cli("--offload-ratio"),
        description="zero3_offload: fraction of the optimizer states (and their step) on the CPU; the rest stays on the "
        "GPU and steps there (DeepSpeed's partial offload, 'Twin-Flow'); exact AdamW either way")
    zenflow: bool = Field(False, json_schema_extra=cli("--zenflow"),
        description="zero1_offload/zero2_offload: DeepSpeed ZenFlow, NOT bit-exact AdamW: the top 10% gradient columns "
        "step on the GPU every step, the rest on the CPU asynchronously and less often (stale updates)")
    bind_cores: bool = Field(True, description="CPU-optimizer strategies and CPU-device runs: pin each rank's threads to its share of the cores "
                             "(what DeepSpeed's launcher does with --bind_cores_to_rank)")
    pp_stages: int | None = Field(None, gt=0, json_schema_extra=cli("--stages"),
        description="pipeline: number of ranks the layers are split over (default: all)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv"] = Field("1f1b", json_schema_extra=cli("--schedule"),
        description="pipeline: gpipe, 1f1b, interleaved-1f1b or zbv (zero-bubble V: 2 stages per rank in a V, backward split "
        "into input and weight gradients)")
    pp_chunks: int = Field(2, gt=0, json_schema_extra=cli("--chunks"),
        description="interleaved-1f1b: model chunks (virtual stages) per rank (zbv always has 2)")


class AdapterConfig(_Strict):
    """Low-rank adapters through the peft library: small added matrices train, the base model's weights stay frozen
    (training/adapters.py)."""

    method: Literal["lora", "qlora"] | None = Field(None, json_schema_extra=cli("--peft"),
        description="'lora': low-rank adapters (peft's LoraConfig) on the frozen base model; 'qlora': the same on a base "
        "whose adapted linear layers are stored in 4-bit NF4 (bitsandbytes); not set: full fine-tuning")
    r: int = Field(8, gt=0, json_schema_extra=cli("--lora-r"),
        description="adapter rank: an adapted layer's weight W (out x in) gains the update B A, B out x r, A r x in")
    alpha: float = Field(16.0, gt=0, json_schema_extra=cli("--lora-alpha"),
        description="the update B A is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, json_schema_extra=cli("--lora-dropout"),
        description="dropout on the adapters' input (--dropout sets the base model's)")
    target_modules: str | list[str] = Field(
        "all-linear", description="the layers that get adapters: 'all-linear' (every linear layer but the output head, "
        "peft's shorthand) or a list of module names, matched as name suffixes: [q_proj, v_proj], [c_attn]")


class CurriculumStage(_Strict):
    name: str | None = Field(None, description="a name for the stage in logs (optional)")
    dataset: DatasetConfig
    epochs: float | None = Field(None, gt=0, description="epochs of this stage's data, fractions allowed")
    max_steps: int | None = Field(None, gt=0, description="stop this stage after this many optimizer steps")


class RunConfig(_Strict):
    # model
    model: str = Field("tiny-gpt2", json_schema_extra=cli("--model"),
        description="preset (tiny-gpt2, gpt2-medium, bloom-560m, ...), hub id or local directory")
    tokenizer: str | None = Field(None, json_schema_extra=cli("--tokenizer"),
        description="tokenizer hub id or directory (default: the model's own / offline GPT-2 BPE)")
    trust_remote_code: bool = Field(False, json_schema_extra=cli("--trust-remote-code"),
        description="allow model code from the hub (off by default)")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", json_schema_extra=cli("--attn-implementation"),
        description="auto, sdpa, eager or flash_attention_2")
    gradient_checkpointing: bool = Field(False, json_schema_extra=cli("--gradient-checkpointing"),
        description="recompute activations in backward")
    dropout: float | None = Field(None, ge=0.0, lt=1.0, json_schema_extra=cli("--dropout"),
        description="override the model's dropout probabilities (default: the model's own)")
    # data
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    seq_len: int = Field(128, gt=0, json_schema_extra=cli("--seq-len"),
        description="tokens per sequence")
    # batch triple: any two determine the third (with the data-parallel world size)
    micro_batch: int | Literal["auto"] | None = Field(None, json_schema_extra=cli("--micro-batch"),
        description="sequences per GPU per forward pass, or 'auto' (largest that runs: plan + short trials) (default: 8, "
        "or from --global-batch)")
    grad_accum: int | None = Field(None, gt=0, json_schema_extra=cli("--grad-accum", also={
        "--microbatches": "pipeline: micro-batches per step (the same setting as --grad-accum, and the same default)"}),
        description="micro-batches accumulated per optimizer step (default: 1, or from --global-batch)")
    global_batch: int | None = Field(None, gt=0, json_schema_extra=cli("--global-batch"),
        description="sequences per optimizer step over all GPUs (default: micro x accum x world)")
    cpu_memory_budget_gb: float | None = Field(None, gt=0, json_schema_extra=cli("--cpu-memory-budget-gb"),
        description="--micro-batch auto on CPU: host RAM the run may use, GiB (default: half of the RAM available); "
        "given, the run also keeps glibc's default of returning freed memory, which the budget is planned with "
        "(runtime.distributed.reuse_freed_heap)")
    # length of training
    epochs: float | None = Field(None, gt=0, json_schema_extra=cli("--epochs"),
        description="epochs to train, fractions allowed (default: 1, unless --max-steps is given)")
    max_steps: int | None = Field(None, gt=0, json_schema_extra=cli("--max-steps"),
        description="stop after this many optimizer steps (default: no limit, the epochs decide)")
    # optimisation
    lr: float = Field(5e-5, gt=0, json_schema_extra=cli("--lr"),
        description="peak learning rate")
    warmup_steps: int = Field(0, ge=0, json_schema_extra=cli("--warmup-steps"),
        description="linear warm-up steps from 0, as in transformers' schedules (the first step uses lr 0, the next 1/N of --lr)")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", json_schema_extra=cli("--lr-schedule"),
        description="cosine, linear or constant after warm-up")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="the learning rate the schedule ends at, as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0.0, json_schema_extra=cli("--weight-decay"),
        description="AdamW weight decay (matrices only)")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="AdamW's beta1 (first-moment decay)")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW's beta2 (second-moment decay)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    max_grad_norm: float | None = Field(1.0, gt=0, json_schema_extra=cli("--max-grad-norm"),
        description="gradient clipping norm")
    optimizer: Literal["adamw", "adamw8bit"] = Field("adamw", json_schema_extra=cli("--optimizer"),
        description="'adamw' = exact fp32 AdamW; 'adamw8bit' = torchao's AdamW8bit (block-wise 8-bit moments, 2 B/param "
        "of state instead of 8; dp, fsdp)")
    optimizer_in_backward: bool = Field(False, json_schema_extra=cli("--optimizer-in-backward"),
        description="step each parameter in its gradient hook and free its gradient at once (as torchtune does; dp on one "
        "rank, fsdp): no full set of gradients is ever held; needs grad_accum 1 and no global-norm clipping")
    master_weights: Literal["fp32", "bf16"] = Field("fp32", json_schema_extra=cli("--master-weights"),
        description="the weights the optimizer updates: 'fp32' (autocast computes in --precision over fp32 weights), or "
        "'bf16' = bf16 weights and gradients with no fp32 copy (2 + 2 B/param instead of 4 + 4; torchao's AdamW8bit rounds "
        "each update into bf16 stochastically, as torchtune's bf16 recipes do; not bit-exact mixed precision; dp with "
        "--optimizer adamw8bit --precision bf16)")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", json_schema_extra=cli("--precision"),
        description="auto, bf16, fp16 or fp32")
    compile: bool = Field(False, json_schema_extra=cli("--compile"),
        description="torch.compile the model")
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"] = Field(
        "default", description="with --compile: torch.compile's mode. 'max-autotune-no-cudagraphs' benchmarks GEMM and "
        "Triton configurations while compiling (minutes more compile time, cached); 'reduce-overhead' and 'max-autotune' "
        "also capture CUDA graphs (static memory pools the planner does not model) (shardlab.training.compiling)")
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = Field(
        "auto", description="the attention kernel F.scaled_dot_product_attention tries first: 'auto' = torch's own choice "
        "(cuDNN's kernels on an H100 with torch 2.11); for flash / efficient / cudnn the other fused kernels stay behind "
        "the chosen one as fallbacks; 'math' = the unfused reference alone; 'efficient' and 'cudnn' need CUDA "
        "(shardlab.training.attention_backend)")
    compile_scope: Literal["auto", "model", "blocks"] = Field(
        "auto", description="with --compile: 'model' = one graph of the whole model, 'blocks' = each decoder block compiled on "
        "its own (as torchtitan does; gradients appear block by block), 'auto' = blocks for ao_offload and "
        "--optimizer-in-backward, model otherwise (shardlab.training.compiling)")
    pin_thread: Literal["auto", "on", "off"] = Field(
        "auto", json_schema_extra=cli("--pin-thread"),
        description="pin each rank's training thread and autograd's device thread to one CPU of the rank's cores after the "
        "first step (threads and processes it starts later get the full set): ZeRO-3 on one H100 is host-bound and ran "
        "1.01x dp pinned vs 0.80x unpinned. auto: CUDA dp/zero1-3/fsdp runs, eager, no offload; on: also compiled runs and "
        "other GPU strategies without offload; off: never (shardlab.runtime.pin)")
    loss_kernel: Literal["auto", "compiled", "hf", "liger"] = Field(
        "auto", description="the LM loss: 'compiled' = one fused torch.compile kernel (no fp32 logits copies), 'hf' = the model's own, "
        "'liger' = Liger-Kernel's fused linear cross-entropy (the head inside the loss: no logits at all; CUDA, dp and "
        "zero0-2), 'auto' = compiled on CUDA, hf on CPU (shardlab.training.loss)")
    eval_loss_chunk_mib: int = Field(
        512, ge=0, description="the eval loss (no grad) upcasts the logits to fp32 a chunk of tokens at a time, each chunk "
        "holding at most this many MiB of fp32 copies (0 = the whole eval batch at once: 8 B more a logit; BLOOM's "
        "250,880-token rows are 2 GB each) (shardlab.training.loss.chunked_causal_lm_loss)")
    pad_head: bool | None = Field(
        None, description="run the output head's matmul on the vocabulary padded to a multiple of 64 and slice the padded "
        "logits off (exact: same logits and gradients; GPT-2's 50,257 tokens otherwise take slow unaligned GEMM kernels, "
        "+16.5% for an eager gpt2-medium loop on an H200); None = on CUDA GPUs when the vocabulary needs it "
        "(shardlab.training.head_padding)")
    # strategy
    strategy: str = Field(DEFAULT_STRATEGY, json_schema_extra=cli("--strategy"),
        description="one of: " + ", ".join(STRATEGIES))
    strategy_options: StrategyOptions = Field(default_factory=StrategyOptions)
    peft: AdapterConfig = Field(default_factory=AdapterConfig)
    deepspeed_config: str | None = Field(None, json_schema_extra=cli("--deepspeed-config"),
        description="your own DeepSpeed JSON, 'auto' values filled in (default: none, shardlab writes the whole JSON)")
    # where it runs
    device: Literal["auto", "cuda", "cpu"] = Field("auto", json_schema_extra=cli("--device"),
        description="auto, cuda or cpu")
    gpus: int | None = Field(None, json_schema_extra=cli("--gpus"),
        description="processes (GPUs) per node; on CPU the number of worker processes (default: every visible GPU; 1 on "
        "CPU)")
    nodes: int = Field(1, gt=0, json_schema_extra=cli("--nodes"),
        description="number of nodes")
    node_rank: int = Field(0, ge=0, json_schema_extra=cli("--node-rank"),
        description="this node's index")
    master_addr: str = Field("127.0.0.1", json_schema_extra=cli("--master-addr"),
        description="address of node 0")
    master_port: int = Field(29500, gt=0, lt=65536, json_schema_extra=cli("--master-port"),
        description="port on node 0")
    hostfile: str | None = Field(None, json_schema_extra=cli("--hostfile"),
        description="DeepSpeed-style hostfile ('host slots=N'): nodes, GPUs per node, master, node rank (default: none, "
        "the flags decide)")
    dist_timeout_s: int = Field(1800, gt=0, json_schema_extra=cli("--dist-timeout"),
        description="seconds a collective waits for a silent rank before the job fails")
    seed: int = Field(42, ge=0, lt=2**32, json_schema_extra=cli("--seed"),
        description="random seed (0 to 2**32 - 1: numpy's range, which the data pipeline seeds too)")
    # outputs
    output_dir: str = Field("runs/latest", json_schema_extra=cli("--output-dir"),
        description="run directory")
    resume: str | None = Field(None, json_schema_extra=cli("--resume"),
        description="'auto' (latest checkpoint in output_dir) or a checkpoint dir")
    trust_checkpoint: bool = Field(False, json_schema_extra=cli("--trust-checkpoint"),
        description="resume from a checkpoint that shardlab did not write for this user even where its pickles hold more "
        "than tensors and plain data (loading it may run its code); without it such a checkpoint is refused")
    overwrite: bool = Field(False, json_schema_extra=cli("--overwrite"),
        description="output_dir holds another run: delete its files first (else the run is refused)")
    log_every: int = Field(10, gt=0, json_schema_extra=cli("--log-every"),
        description="optimizer steps between metrics rows")
    eval_every: int | None = Field(None, gt=0, json_schema_extra=cli("--eval-every"),
        description="optimizer steps between evals (default: each epoch end)")
    eval_at_start: bool = Field(True, json_schema_extra=cli("--eval-at-start"),
        description="evaluate once before the first step: summary.json's initial_eval_loss")
    early_stopping_patience: int | None = Field(None, gt=0, json_schema_extra=cli("--early-stopping-patience"),
        description="stop after this many evaluations in a row without a lower eval loss than the best so far")
    save_best: bool = Field(False, json_schema_extra=cli("--save-best"),
        description="keep the checkpoint of the lowest eval loss (checkpoints/best) and export that step, not the last")
    samples: bool = Field(False, json_schema_extra=cli("--samples"),
        description="write samples.md: greedy completions of sample_prompts before and after training (rank 0, on the "
        "CPU, from the model as loaded and from the exported one)")
    sample_prompts: list[str] | None = Field(None, description="prompts for samples.md (default: shardlab.loop.generate.SAMPLE_PROMPTS)")
    save_every: int | None = Field(None, gt=0, json_schema_extra=cli("--save-every"),
        description="optimizer steps between checkpoints (default: no periodic checkpoints)")
    keep_checkpoints: int = Field(2, gt=0, json_schema_extra=cli("--keep-checkpoints"),
        description="how many recent checkpoints to keep")
    save_each_epoch: bool = Field(False, json_schema_extra=cli("--save-each-epoch"),
        description="also checkpoint at the end of every epoch")
    nan_policy: Literal["stop", "skip"] = Field("stop", json_schema_extra=cli("--nan-policy"),
        description="non-finite loss or gradients: stop naming the step, or skip that optimizer step")
    export: bool = Field(True, json_schema_extra=cli("--export"),
        description="save the final model in HF format under output_dir/model")
    monitor_interval_s: float = Field(0.5, gt=0, description="seconds between GPU (NVML) and process-tree (psutil) memory samples")
    tensorboard: bool = Field(False, json_schema_extra=cli("--tensorboard"),
        description="log to TensorBoard")
    wandb: bool = Field(False, json_schema_extra=cli("--wandb"),
        description="log to Weights & Biases")
    profile: bool = Field(False, json_schema_extra=cli("--profile"),
        description="torch.profiler trace + op table of a few steady-state steps (output_dir/profile)")
    wandb_project: str = Field("shardlab", description="the Weights & Biases project of --wandb runs")
    curriculum: list[CurriculumStage] | None = Field(None, description="stages trained in order with one optimizer and "
        "schedule, each with its own dataset and length (in place of dataset and epochs; a top-level max_steps caps the whole "
        "curriculum)")

    @field_validator("pin_thread", mode="before")
    @classmethod
    def _pin_thread_yaml_bool(cls, value: Any) -> Any:
        # YAML 1.1 (and so `--set pin_thread=off`) reads on/off as booleans.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch_int_or_auto(cls, value: Any) -> Any:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        raise ValueError(f"'micro_batch' must be a positive integer or 'auto', got {value!r}")

    @field_validator("gpus")
    @classmethod
    def _gpus_at_least_one(cls, value: int | None) -> int | None:
        # One rule for train, plan, bench and slurm: 0 is no "CPU mode" (that is --device cpu, where --gpus N is N workers).
        if value is not None and value < 1:
            raise ValueError(f"gpus {value}: --gpus is processes per node and must be at least 1 (on CPU, --device cpu --gpus N "
                             "runs N worker processes)")
        return value

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.strategy not in names():  # live: a strategy registered after import is valid too
            near = difflib.get_close_matches(self.strategy.strip().lower().replace("-", "_"), names(), n=1, cutoff=0.7)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"unknown strategy {self.strategy!r}; {hint}choose one of {', '.join(names())}")
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nodes {self.nodes}")
        if self.curriculum and (self.early_stopping_patience or self.save_best):
            raise ValueError("early_stopping_patience and save_best compare eval losses of one eval split; a curriculum's "
                             "stages each have their own (run the stages as separate runs)")
        return self

    # ---- derived -------------------------------------------------------------------------------
    def resolve_batch(self, dp_world: int) -> tuple[int, int, int]:
        """Return (micro_batch, grad_accum, global_batch) with global = micro * accum * dp_world.

        Any two given determine the third; all three given must agree; with fewer than two the
        defaults are micro 8 (or global/world) and accumulation 1.
        """
        micro, accum, glob = self.micro_batch, self.grad_accum, self.global_batch
        if micro == "auto":
            raise UserError(
                "micro_batch 'auto' has no value until the search has run",
                "`shardlab train` resolves it before the run (library: shardlab.planning.autobatch.resolve_auto_micro_batch)",
            )
        if glob is not None and glob % dp_world:
            raise UserError(
                f"global_batch {glob} is not divisible by the data-parallel world size {dp_world}",
                f"use a global batch that is a multiple of {dp_world}, or change --gpus",
            )
        if micro is not None and accum is not None:
            derived = micro * accum * dp_world
            if glob is not None and glob != derived:
                raise UserError(
                    f"batch sizes disagree: micro_batch {micro} x grad_accum {accum} x world {dp_world} = "
                    f"{derived}, but global_batch is {glob}",
                    "give only two of --micro-batch, --grad-accum, --global-batch and shardlab derives the third",
                )
            return micro, accum, derived
        if glob is not None:
            per_rank = glob // dp_world
            if micro is None and accum is None:
                micro, accum = per_rank, 1
            elif micro is not None:
                if per_rank % micro:
                    raise UserError(
                        f"global_batch {glob} / world {dp_world} = {per_rank} is not divisible by micro_batch {micro}",
                        "choose a micro batch that divides the per-rank batch, or set --grad-accum instead",
                    )
                accum = per_rank // micro
            else:
                assert accum is not None
                if per_rank % accum:
                    raise UserError(
                        f"global_batch {glob} / world {dp_world} = {per_rank} is not divisible by grad_accum {accum}",
                        "choose a gradient accumulation that divides the per-rank batch, or set --micro-batch",
                    )
                micro = per_rank // accum
            return micro, accum, glob
        micro = micro or 8
        accum = accum or 1
        return micro, accum, micro * accum * dp_world

    def with_pipeline_microbatches(self, world: int) -> tuple["RunConfig", str | None]:
        """``strategy: pipeline`` without ``grad_accum`` (``--microbatches``): a default of two micro-batches per stage.

        A step of a pipeline is its micro-batches; with the batch triple's default of 1, 1F1B cannot even start
        (torch demands one per stage) and GPipe would idle all but one stage. Two per stage keep the bubble at
        (S-1)/(3S-1) of the step. A given global batch takes the largest of 2S and S that divides it per pipeline.
        Returns the config to run and the line to log (None when nothing was chosen)."""
        if spec(self.strategy).engine != "pipelining" or self.grad_accum is not None or world < 1:
            return self, None

        stages = pipeline_stages(self, world)
        if world % stages or (isinstance(self.micro_batch, int) and self.global_batch is not None):
            return self, None  # the layout check reports the first; the triple derives M in the second
        options = (2 * stages, stages)
        m = options[0]
        if self.global_batch is not None:
            dp = data_parallel_size(self, world)
            if self.global_batch % dp:
                return self, None  # resolve_batch reports it
            per_pipeline = self.global_batch // dp
            m = next((o for o in options if per_pipeline % o == 0), 0)
            if not m:
                raise UserError(
                    f"pipeline: global_batch {self.global_batch} gives {per_pipeline} sequences per pipeline, which {stages} "
                    f"stages cannot split into micro-batches evenly (a step needs at least one micro-batch per stage)",
                    f"use a global batch that is a multiple of {stages * dp}, or set --microbatches",
                )
        note = (f"pipeline: --microbatches not given: {m} micro-batches per step ({m // stages} per stage for {stages} stages; "
                f"1f1b needs at least one per stage)")
        return self.model_copy(update={"grad_accum": m}), note

    def stages(self) -> list[CurriculumStage]:
        """The training stages: the curriculum, or one stage from the top-level dataset/epochs."""
        if self.curriculum:
            return list(self.curriculum)
        epochs = self.epochs if (self.epochs is not None or self.max_steps is not None) else 1.0
        return [CurriculumStage(name="train", dataset=self.dataset, epochs=epochs, max_steps=self.max_steps)]


# --------------------------------------------------------------------------------------------------
# Loading: YAML file + overrides -> RunConfig, with one-line errors


def _key_fix(loc: tuple) -> str:
    """The fix for an unknown key: the closest valid key at its level, or the valid keys there."""
    model: Any = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # a list item (curriculum stages)
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return "remove it or check its spelling"
        inner = [field.annotation, *typing.get_args(field.annotation)]
        inner += [a for t in inner for a in typing.get_args(t)]  # list[Stage] | None
        model = next((t for t in inner if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if model is None:
        return "remove it or check its spelling"
    keys = sorted(model.model_fields)
    prefix = ".".join(str(x) for x in loc[:-1])
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if near:
        return f"did you mean {'.'.join(filter(None, [prefix, near[0]]))!r}?"
    return f"remove it; the keys{' of ' + repr(prefix) if prefix else ''} are: {', '.join(keys)}"


def _format_validation_error(err: ValidationError) -> UserError:
    errors = err.errors()
    # a misspelt key is also a missing one: name the misspellings, the root cause; all of them, so one edit fixes the file
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        names = [".".join(str(p) for p in loc) for loc in unknown]
        fixes = [_key_fix(loc) for loc in unknown]
        if len(unknown) == 1:
            return UserError(f"unknown config key {names[0]!r}", fixes[0])
        return UserError(f"{len(unknown)} unknown config keys: {', '.join(map(repr, names))}",
                         "; ".join(f"{name}: {fix}" for name, fix in zip(names, fixes)))
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    kind = first["type"]
    if kind == "missing":
        return UserError(f"missing config key {where!r}", "add it to your YAML")
    if kind == "value_error":
        msg = str(first.get("ctx", {}).get("error", first["msg"]))
        return UserError(f"invalid config: {msg}", "fix the value in your YAML or flags")
    got = first.get("input")
    return UserError(
        f"invalid value for {where!r}: {first['msg'].lower()} (got {got!r})",
        "fix the value in your YAML or flags",
    )


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``5e-5`` as a float (YAML 1.1 demands ``5.0e-5``, a classic trap)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {str(path)!r} not found", "check the path given to --config")
    try:
        data = yaml.load(path.read_text(), Loader=YamlLoader) or {}  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if mark is not None and "\\t" in str(getattr(exc, "problem", "")):  # YAML forbids tabs in indentation: name the cause
            raise UserError(f"config file {str(path)!r} has a tab character at line {mark.line + 1}:{mark.column + 1}; "
                            "YAML indents with spaces only", "replace the tab with spaces") from None
        where = f" at line {mark.line + 1}:{mark.column + 1}" if mark else ""
        found = re.search(r"tag '([^']+)'", str(getattr(exc, "problem", "")))
        if isinstance(exc, yaml.constructor.ConstructorError) and found:  # valid YAML, with a tag safe_load will not construct
            tag = found.group(1).replace("tag:yaml.org,2002:", "!!")  # as the file spells it
            if tag.startswith("!!python/"):
                raise UserError(f"config file {str(path)!r} has the executable YAML tag {tag}{where}: tags that build Python "
                                "objects or run code are not allowed (shardlab reads YAML with safe_load)",
                                "remove the tag and write the plain value") from None
            raise UserError(f"config file {str(path)!r} has the YAML tag {tag}{where}, which shardlab does not read",
                            "remove the tag and write the plain value") from None
        raise UserError(f"config file {str(path)!r} is not valid YAML{where}", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {str(path)!r} must hold a mapping of keys", "write `key: value` lines")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, sets: dict[str, Any] | None = None) -> RunConfig:
    """Build a RunConfig from an optional YAML file and dotted-key overrides.

    `overrides` are flag values, where None means "flag not given" and is skipped; `sets` are
    explicit `--set key=value` assignments, applied as they are, so `--set max_grad_norm=null`
    really turns clipping off.
    """
    data: dict[str, Any] = read_yaml(path) if path else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    for key, value in (sets or {}).items():
        set_dotted(data, key, value)
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise _format_validation_error(err) from None


def dump_config(cfg: RunConfig, given_only: bool = False) -> str:
    """The config as YAML. ``given_only``: only what was given (pydantic's fields set, nested too), for a file another
    process runs (spawned workers, SLURM jobs, `--micro-batch auto` trials, bench cells): there shardlab's choices for
    what was left open (the strategy a DeepSpeed JSON implies, anything it derives later) must stay open. A full dump
    reads back as if every field had been given (the run directory's config.yaml is the record of what ran)."""
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude_unset=given_only), sort_keys=False)


def parse_set(values: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE ...` (train, plan, bench) as overrides, each value read as YAML like --config."""
    out: dict[str, Any] = {}
    for item in values:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE", "write e.g. --set strategy_options.overlap_comm=false")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.load(raw, Loader=YamlLoader)  # noqa: S506 - SafeLoader subclass; reads 5e-5 as a float like --config does
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: {raw!r} is not a valid YAML value", "quote strings, e.g. --set 'key=\"a: b\"'") from None
    return out
