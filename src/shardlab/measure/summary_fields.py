"""What each summary.json field means: one line per field of ``RunSummary`` and of its nested records.

The docs' summary reference is generated from the dataclasses in summary.py (names, types, order) and these lines
(meanings); tests/test_docs_reference.py fails when a field has no line here, or a line names no field, so a new
field is documented where it is added. Keys are dotted paths: ``plan.gpu_peak_gib``; ``[]`` marks a list of
records (``gpu_monitor.gpus[].name``). ``EXTRAS`` are the keys strategies add beside the typed fields.
"""

from __future__ import annotations

FIELDS: dict[str, str] = {
    # the run
    "model": "the model as given: a preset name, a hub id, a local directory or a GGUF file",
    "strategy": "the strategy the run trained with (`--strategy`, or the one a DeepSpeed JSON implied)",
    "precision": "the precision the run computed in, after `auto` was resolved: bf16, fp16 or fp32",
    "device_type": "cuda or cpu",
    "world_size": "ranks (processes) over all nodes",
    "micro_batch": "sequences per rank per forward pass (the resolved batch triple)",
    "grad_accum": "micro-batches accumulated per optimizer step",
    "global_batch": "sequences per optimizer step over all ranks: micro x accum x data-parallel size",
    "seq_len": "tokens per sequence",
    "steps": "optimizer steps taken",
    "tokens_per_step": "tokens per optimizer step over all ranks (padding included)",
    "n_params": "the model's parameter count",
    "param_bytes": "bytes of the model's parameters as built",
    "adapter": "`--peft` runs: the method (lora, qlora), r, alpha, dropout, target_modules as given, the layer names that "
               "got adapters (adapted_layers), how the base weights were kept (base_weights), and trainable_params of "
               "total_params (the base's and the adapters'), trainable_fraction; null without --peft",
    "final_train_loss": "the training loss of the last optimizer step",
    "final_eval_loss": "held-out loss after the last step (null without an eval split)",
    "final_eval_ppl": "exp(final_eval_loss)",
    "non_pad_fraction": "share of the tokens that are real text, not padding (1.0 for packed data)",
    "warmup_steps_excluded": "steps left out of the throughput figures (compilation and allocator warm-up)",
    "total_time_s": "seconds of the training loop, from its start to the last step (start-up before it: time_to_first_step_s)",
    "compile": "whether the model ran under torch.compile (`--compile`)",
    "compile_scope": "with --compile: `model` (one graph) or `blocks` (one per decoder block)",
    "compile_mode": "with --compile: torch.compile's mode",
    "sdpa_backend": "the attention kernel SDPA tried first (`auto`: torch's order)",
    "time_to_first_step_s": "seconds from the command's start (a library call's: `shardlab.train()`) to the end of the "
                            "first optimizer step",
    "startup_s": "time_to_first_step_s split into phases: launch_and_imports, data, model_build, engine_setup, "
                 "optimizer_compile, initial_eval, first_step (seconds each)",
    "compile_time_s": "seconds torch spent compiling (torch's own compile metrics); excluded from epoch_time_s",
    "compile_time_source": "where compile_time_s comes from (torch's counters, or none when nothing compiled)",
    "compile_cache": "inductor FX-graph and AOTAutograd cache hits and misses: `hit` is true when every compiled graph "
                     "came from the cache (kept under $SHARDLAB_CACHE/inductor)",
    "loss_kernel": "the loss that trained: compiled, hf or liger (after `auto` was resolved)",
    "gradient_checkpointing": "whether activations were recomputed in backward",
    "skipped_steps": "optimizer steps skipped for a non-finite loss or gradient (`--nan-policy skip`)",
    "overflow_steps": "fp16 steps the loss scaler skipped",
    # throughput over the steady steps
    "step_time_median_s": "median seconds per optimizer step over the timed (steady) steps",
    "step_time_min_s": "fastest timed step, seconds",
    "step_time_max_s": "slowest timed step, seconds",
    "tokens_per_s": "tokens_per_step / step_time_median_s: all tokens (padding included) per second, all ranks together",
    "useful_tokens_per_s": "non-padding tokens per second at the median step time, all ranks together: the figure MFU uses",
    "samples_per_s": "sequences per second at the median step time",
    "steps_per_s": "1 / step_time_median_s",
    "timed_steps": "how many steps the throughput figures average (steps minus warmup_steps_excluded)",
    # peak memory
    "gpu_mem_peak_gib": "the largest torch.cuda.max_memory_allocated over the ranks, in GiB: what the tensors of one GPU "
                        "held at their peak (the figure `shardlab plan` predicts; absent on CPU). The allocator's cache, "
                        "the CUDA context and NCCL come on top: see gpu_mem_peak_reserved_gib and gpu_monitor",
    "gpu_mem_peak_reserved_gib": "the largest torch.cuda.max_memory_reserved over the ranks, GiB: allocated plus what the "
                                 "caching allocator kept (absent on CPU)",
    "cpu_rss_peak_rank_gib": "the largest resident-memory high-water mark of one rank's process, GiB (the kernel's "
                             "ru_maxrss)",
    "cpu_rss_max_rank_gib": "the largest resident memory of one rank sampled at the end of training, GiB",
    # evaluation and early stopping
    "initial_eval_loss": "held-out loss before the first step (`--eval-at-start`, on by default)",
    "best_eval_loss": "the lowest held-out loss of the run",
    "best_step": "the step of best_eval_loss (the checkpoint in checkpoints/best with --save-best)",
    "stopped_early": "whether --early-stopping-patience ended the run",
    "early_stopping_patience": "the patience the run used (evaluations without a new best)",
    "epochs": "one entry per epoch: stage, epoch, steps, train_loss, eval figures, epoch_time_s (without compile time), "
              "epoch_wall_time_s (with it), compile_time_s",
    # strategy figures
    "optimizer": "the optimizer arithmetic that ran (exact AdamW, 8-bit, in backward, where its states live)",
    "time_split": "offload strategies: where one step's time goes (GPU compute, CPU optimizer, idle, transfers)",
    "cpu_threads": "torch's intra-op threads on rank 0",
    "bound_cores": "CPU cores rank 0's threads were bound to (0: not bound)",
    "thread_pin": "the training-thread pin (`--pin-thread`): mode, the CPU pinned to (null: not pinned) and why",
    "pinned_released_gib": "cached pinned host memory given back, GiB, by moment (engine set-up, after the first step)",
    "eight_bit_warmup": "GPU runs with --optimizer adamw8bit: the 8-bit step's graphs compiled before training, the "
                        "seconds it took and its GPU peak against the plan",
    # MFU and the projected epoch
    "flops_per_token": "model FLOPs per trained token: 6N + 12*L*H*Q*T (PaLM appendix B)",
    "flops_formula": "the formula flops_per_token used, in words",
    "flops_counted": "which FLOPs flops_per_token counts: '6 x params per token + attention', or with --peft '4 x frozen + 6 x "
                     "trainable params per token + attention' (a frozen weight gets no weight gradient)",
    "model_tflops_per_s": "useful_tokens_per_s x flops_per_token, in TFLOP/s over all devices",
    "device_name": "the GPU's name (or cpu), used to look up its dense peak",
    "peak_tflops_per_device": "the device's dense peak TFLOP/s for the precision in use (null when unknown: no MFU then)",
    "peak_math_mode": "which peak applies: bf16, fp16, tf32 or fp32 matmuls",
    "mfu": "model FLOPs utilisation: model_tflops_per_s / (devices x peak_tflops_per_device), from useful tokens",
    "mfu_all_tokens": "MFU counting padding tokens as trained tokens",
    "mfu_note": "why no MFU is reported, when it is not",
    "steps_per_epoch": "optimizer steps in one epoch of the training data",
    "epoch_time_projected_s": "steps_per_epoch x step_time_median_s: an epoch's time at the measured speed",
    "memory_per_rank": "per rank: its peak GPU memory (allocated and reserved) and host RSS",
    # after the training loop
    "plan": "the launcher's memory prediction for this run (`shardlab plan`'s figures for its strategy)",
    "exported_step": "the step whose weights are in model/ (the best one with --save-best)",
    "export_dir": "where the Hugging Face export was written (model/ in the run directory)",
    "patches": "the patches of dependencies' private code this run applied (rank 0), in order: see the patches "
               "table in the docs (shardlab.compat.PATCHES)",
    "patches_off": "the patches this run considered and left off, with why: a dependency outside the versions the "
                   "patch was tested on, or SHARDLAB_PATCHES (null: none)",
    # the monitor
    "gpu_monitor": "the GPUs sampled through NVML over the whole run (gpu_memory.csv), or why they were not",
    "cpu_monitor": "the run's process tree sampled through psutil (cpu_memory.csv), or why it was not",
    # time_split
    "time_split.steps_measured": "steps the split averages",
    "time_split.step_s": "mean wall seconds per step",
    "time_split.gpu_compute_s": "GPU busy time per step (CUDA events)",
    "time_split.cpu_optimizer_s": "CPU optimizer step per step",
    "time_split.idle_s": "the rest of the step: neither GPU compute nor the CPU optimizer",
    "time_split.transfer_s": "estimated host<->device transfer time per step",
    "time_split.transfer_note": "how transfer_s was estimated",
    "time_split.h2d_gb_per_step": "GB copied host to device per step",
    "time_split.d2h_gb_per_step": "GB copied device to host per step",
    "time_split.pinned_h2d_gbps": "measured pinned host-to-device bandwidth, GB/s",
    "time_split.pinned_d2h_gbps": "measured pinned device-to-host bandwidth, GB/s",
    # plan
    "plan.gpu_peak_gib": "predicted peak torch.cuda.max_memory_allocated per GPU, GiB (null on CPU): compare with "
                         "gpu_mem_peak_gib",
    "plan.cpu_gib": "predicted host memory per node, GiB (on CPU: the whole run, all ranks)",
    "plan.cpu_gib_cached": "--compile runs on GPUs: the predicted host memory per node when inductor's cache already "
                           "holds every graph, so its compile workers compile nothing (null without a compile pool); "
                           "compare with the measured host of a run whose `compile_cache` shows no FX-graph miss",
    "plan.fits": "whether the prediction fits the GPU with the CUDA context and the fragmentation allowance (null on CPU)",
    "plan.strategy": "the strategy the prediction was made for",
    "plan.device": "cuda or cpu",
    "plan.error": "why planning failed (planning never stops a run; the figures are null then)",
    # gpu_monitor
    "gpu_monitor.available": "whether NVML sampling ran",
    "gpu_monitor.reason": "why it did not (no driver, no GPU)",
    "gpu_monitor.csv": "the samples' file in the run directory (gpu_memory.csv)",
    "gpu_monitor.interval_s": "seconds between samples",
    "gpu_monitor.samples": "samples taken per GPU",
    "gpu_monitor.gpus": "one record per GPU sampled",
    "gpu_monitor.gpus[].index": "the GPU's index",
    "gpu_monitor.gpus[].name": "the GPU's name",
    "gpu_monitor.gpus[].memory_total_mib": "the GPU's memory, MiB",
    "gpu_monitor.gpus[].memory_used_mib": "NVML memory.used of this GPU, MiB (peak / mean / min)",
    "gpu_monitor.gpus[].utilization_pct": "NVML utilisation of this GPU, % (peak / mean / min)",
    "gpu_monitor.memory_used_mib": "the busiest GPU's peak, the mean over GPUs and the lowest minimum of memory.used, MiB "
                                   "(CUDA context, NCCL and the allocator's cache included)",
    "gpu_monitor.utilization_pct": "utilisation over all GPUs, %",
    "gpu_monitor.note": "what the figures include",
    # cpu_monitor
    "cpu_monitor.available": "whether psutil sampling ran",
    "cpu_monitor.reason": "why it did not",
    "cpu_monitor.csv": "the samples' file in the run directory (cpu_memory.csv)",
    "cpu_monitor.interval_s": "seconds between samples",
    "cpu_monitor.samples": "samples taken",
    "cpu_monitor.duration_s": "seconds sampled",
    "cpu_monitor.max_processes": "the most processes the tree held at once",
    "cpu_monitor.real_mb": "resident memory summed over the process tree, MB (peak / mean / min): the host figure the "
                           "plan's cpu_gib predicts",
    "cpu_monitor.virtual_mb": "virtual memory summed over the process tree, MB",
    "cpu_monitor.cpu_pct": "CPU use summed over the process tree, % of one core (from the second sample on)",
    "cpu_monitor.note": "what the figures include",
    "cpu_monitor.scope": "which processes were sampled (the launcher and its children)",
    # Stat: peak / mean / min of one sampled quantity
    "*.peak": "the largest sample",
    "*.mean": "the mean of the samples",
    "*.min": "the smallest sample",
}

# Keys a strategy adds to summary.json beside the typed fields (Strategy.summary_extras); kept, in order, by RunSummary.
EXTRAS: dict[str, str] = dict(  # keyword form: these are summary keys, not strategy names compared (test_registry)
    zero_optimization="DeepSpeed strategies: the engine's ZeRO section as it ran (stage, bucket sizes, persistence, "
                      "overlap, offload), shardlab's choices and the user's JSON merged",
    zero3_one_rank_shortcuts="ZeRO-3 on one rank: the shortcuts that ran (keep_gathered, identity_reduce_scatter)",
    zero3_steps_kept_gathered="ZeRO-3 on one rank with keep_gathered: the steps whose parameters stayed gathered",
    pipeline="pipeline strategy: per-stage forward and backward times measured in this run, the measured schedule time "
             "and bubble, and what `shardlab pipeline simulate` predicts from those times",
)
