"""The memory model's shared parts: the allowances, the architecture (``Arch``), what a forward saves for backward
(``activation_bytes``, layer by layer) and one strategy's prediction (``StrategyPlan``).

Read by strategy_plan.py (every strategy) and pipeline.py (the pipeline strategy, per stage); planner.py's docstring says
how the activations are counted and where each allowance comes from. torch-free: run_plan and autobatch read the
allowances without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30

# The CUDA context (driver, kernels' modules, cuBLAS workspace) is outside the torch allocator:
# ~0.5 GiB per process on H100 with torch 2.x; not in max_memory_allocated.
CUDA_CONTEXT_BYTES = int(0.5 * GiB)
# Allocated -> reserved (caching-allocator fragmentation). Measured ratio
# gpu_mem_peak_reserved_gib / gpu_mem_peak_gib in benchmarks/results/h100-foundation-run2/foundation.json:
# dp 1.053, zero2 1.140, zero3 1.130, zero2_offload 1.148, fsdp 1.133. The largest is used for "fits".
RESERVED_OVER_ALLOCATED = 1.15
# Host RAM a prediction must leave free to "fit": measured host peaks came out above the plan by up to 0.4% (bloom-7b1
# zero2_offload 137.2 GiB vs 136.6, zero3_offload --offload-ratio 0.7 114.3 vs 114.0), the kernel and the node's other
# processes hold ~2.5 GiB of a 125.9 GiB H100 machine (123.4 available idle), and bloom-7b1 zero3_offload was OOM-killed
# there with its process tree last sampled at 121.7 GiB (benchmarks/results/*-h100-big-model call 6,
# benchmarks/results/*-h100-big-model). A prediction fits when it times this is at most the RAM.
HOST_HEADROOM = 1.03


def host_fits(need: float, ram: float) -> bool:
    """Whether a host prediction ``need`` fits ``ram`` (same units) with HOST_HEADROOM to spare: the one rule `plan` and
    `train`'s refusal apply."""
    return need * HOST_HEADROOM <= ram


# CPU resident memory of one training process besides the model (python, torch, CUDA libraries,
# data loader): cpu_rss_max_rank_gib of the dp and fsdp cells in the same foundation.json is 1.95 GiB,
# which includes gpt2-medium built in fp32 on the CPU (354,823,168 x 4 B = 1.32 GiB): 1.95 - 1.32 = 0.63 GiB.
PROCESS_RSS_BYTES = int((1.95 - 354_823_168 * 4 / 2**30) * GiB)


# --------------------------------------------------------------------------------------------------
# The architecture (arch.arch_from_hf_config reads it from the config and the meta-device model)


@dataclass
class Arch:
    model: str
    family: str  # gpt2 | bloom | llama | generic
    n_params: int
    largest_layer_params: int  # DeepSpeed's definition: max params held directly by one module
    block_params: int  # largest transformer block (one FSDP unit)
    root_params: int  # params outside the blocks (FSDP root unit: embeddings, final norm, head)
    persistent_params: int  # params with numel <= stage3_param_persistence_threshold (kept whole by ZeRO-3)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    attn_impl: str  # sdpa | flash_attention_2 | eager
    attn_dropout: float
    resid_dropout: float
    embd_dropout: float
    # What strategies/pipeline.py puts on each stage (GPT-2, BLOOM and Llama-style only, else None): parameter counts of
    # the embedding modules (first stage), the final norm and the LM head (last stage), each block; tied head.
    pipeline_parts: dict[str, Any] | None = None
    # (numel, ndim) of every unique parameter: host buffers are allocated per parameter (FSDP2) or per
    # parameter group (DeepSpeed: matrices decay, 1-D tensors do not; optim.param_groups), and pinned ones round up.
    param_sizes: tuple[tuple[int, int], ...] = ()
    # FSDP builds on the meta device (presets, matching local safetensors: models.meta_loadable), else in fp32.
    meta_build: bool = True
    # Random weights (a preset), not a checkpoint's: FSDP on several ranks draws them module by module
    # (strategies.fsdp.random_init_by_module).
    random_init: bool = True
    # The decoder-block class ZeRO-3 makes DeepSpeed leaves (strategies.deepspeed_config.zero3_leaf_classes)
    leaf_classes: tuple[str, ...] = ()
    # Every linear layer but the output head (name, in, out, index of its decoder block or -1): what peft's
    # 'all-linear' adapts and QLoRA quantises (planning/adapters.py)
    linears: tuple[tuple[str, int, int, int], ...] = ()
    # The fp32 weights autocast casts and saves for backward (None: every parameter); an adapter run's frozen base
    # changes it (planning/adapters.autocast_params)
    autocast_weight_params: int | None = None

    @property
    def largest_param(self) -> int:
        """Elements of the largest single parameter (``param_sizes``; DeepSpeed's largest layer where they are unknown)."""
        return max((k for k, _ in self.param_sizes), default=self.largest_layer_params)


# --------------------------------------------------------------------------------------------------
# Activations


def _layer_bytes(arch: Arch, mode: str, device: str) -> tuple[float, float, float]:
    """Saved bytes of one decoder layer as (per s·b·h, per a·s²·b, per s·b).

    ``mode``: 'fp32' (everything fp32), 'lp' (weights and compute in 16-bit: DeepSpeed, FSDP2
    mixed precision) or 'autocast' (torch autocast over fp32 weights, where the run autocasts: training.optim.autocasts).
    ``device``: 'cuda' (1-byte bool dropout masks, fused attention keeps no s² tensors) or 'cpu'
    (masks as wide as the tensor; SDPA with dropout falls back to the math path computed in fp32).
    Counts are per family, tensor by tensor (see the module docstring); the comments give the
    tensors in units of s·b·h elements.
    """
    p = 4 if mode == "fp32" else 2  # compute dtype
    r = 2 if mode == "lp" else 4  # residual stream / norm inputs (fp32 under autocast)
    f = arch.ffn / arch.hidden
    kv = arch.kv_heads / arch.heads
    mask = (1 if device == "cuda" else p)
    n_masks = 0
    if arch.family == "gpt2":
        # ln_1 in (r), c_attn in (p: LN out, or its 16-bit cast under autocast), q,k,v views of the
        # fused c_attn output (3p), attention out = c_proj in (p), ln_2 in (r), c_fc in (p);
        # gelu_new = 0.5*x*(1+tanh(c*(x+0.044715*x**3))) saves x**3's input, tanh out, (1+tanh), 0.5*x
        # (4 x f): all p, or under autocast pow runs in fp32 -> 4+4+4+2 bytes; c_proj in (f x p).
        gelu = {"fp32": 16, "lp": 8, "autocast": 14}[mode]
        per_sbh = 2 * r + p + 3 * p + p + p + gelu * f + p * f
        per_sb = 2 * 2 * 4  # two LayerNorms' fp32 mean and rstd
        n_masks = 2 if arch.resid_dropout > 0 else 0  # attn resid dropout + mlp dropout
    elif arch.family == "bloom":
        # input_layernorm in (r), qkv in (p), q,k,v reshaped copies (3p), dense in (p),
        # post_attention_layernorm in (r), h_to_4h in (p), BloomGelu saves its input (f x p),
        # 4h_to_h in (f x p)
        per_sbh = 2 * r + p + 3 * p + p + p + 2 * p * f
        per_sb = 2 * 2 * 4
        n_masks = 2 if arch.resid_dropout > 0 else 0  # two dropout_add
    elif arch.family == "llama":
        # RMSNorm (x2): pow's input as fp32 (4), normalised fp32 (p or 4), weight*normed = proj in
        # (p, or 4 under autocast + its 16-bit cast 2); q, k, v after RoPE (p + 2kv p), attention out
        # = o_proj in (p); MLP: gate, up, silu(gate), product = down in (4 f x p).
        # Under autocast each projection casts the fp32 norm output itself (autocast caches casts of leaf tensors
        # only, i.e. weights), so q, k and v save three 16-bit copies of it and gate and up two: +3 x 2 B beyond
        # the one counted. smollm2-360m dp micro 8 x 1024 on one H100: 18.82 GiB measured, 17.25 planned without
        # these (benchmarks/results/*-h100-zero3-one-rank/call7); checked on CPU by
        # tests/test_plan.py::test_autocast_casts_an_activation_once_per_projection.
        norm = {"fp32": 12, "lp": 8, "autocast": 10}[mode]
        extra_casts = 3 * 2 if mode == "autocast" else 0
        per_sbh = 2 * norm + extra_casts + (2 + 2 * kv) * p + 4 * f * p
        per_sb = 2 * 4
    else:
        # Korthikanti et al. 2022 eq. (1): 34 s b h bytes in 16-bit (incl. masks), scaled to p
        per_sbh = 34 * p / 2
        per_sb = 0
    per_sbh += n_masks * mask
    # s² terms (per a·s²·b)
    fused = arch.attn_impl in ("sdpa", "flash_attention_2")
    if fused and device == "cuda":
        per_as2b = 0.0
        per_sb += 4 * arch.heads  # fp32 log-sum-exp per row and head
    elif fused and device == "cpu":
        if arch.attn_dropout > 0:  # CPU SDPA with dropout runs the math path in fp32: softmax, mask, dropped
            per_as2b = 12.0
        else:
            per_as2b = 0.0
            per_sb += 4 * arch.heads
    else:  # eager: softmax out (fp32 where the model or autocast upcasts), cast copy or mask + dropped
        if arch.family in ("bloom", "llama") or mode in ("fp32", "autocast"):
            sm = 4
        else:
            sm = p
        if arch.attn_dropout > 0:
            per_as2b = sm + mask + p
        else:
            per_as2b = sm + (p if sm != p else 0)
        if arch.family == "generic":
            per_as2b = 5 * p / 2  # Korthikanti: 5 a s² b in 16-bit
    return per_sbh, per_as2b, per_sb


# The families whose compiled layers were traced (``_compiled_layer_bytes``); others are planned as eager.
COMPILED_FAMILIES = ("gpt2", "llama", "bloom")


def compiled_layers_modelled(arch: Arch) -> bool:
    return arch.family in COMPILED_FAMILIES


def _compiled_layer_bytes(arch: Arch, mode: str, device: str, per_block: bool = False) -> tuple[float, float, float]:
    """Saved bytes of one decoder layer under ``--compile``, as ``_layer_bytes`` counts them for eager runs.

    Inductor's min-cut partitioner (torch._functorch.partitioners) saves what the backward's matmuls need (their
    16-bit inputs, attention's q, k, v and output) and recomputes the cheap pointwise chains from them (GELU's
    polynomial, the norms' normalisation, RoPE, SiLU), so the 4h-wide intermediates that eager autograd keeps
    are gone. Counted from the saved tensors of compiled stacks (benchmarks/compiled_activations.py, torch 2.13 on
    CPU: benchmarks/results/*-cpu-compiled-activations/), per family as ``c_r`` tensors of the residual width (r: fp32
    under autocast) and ``c_p`` of the compute dtype (p), s·b·h elements each: GPT-2 and BLOOM 2 r + (6 + 2f) p, Llama
    2 r + (4 + 2kv + 3f) p, f = ffn/hidden, kv = kv_heads/heads. Dropout keeps 1-byte bool masks (compiled on any
    device); fused attention keeps its log-sum-exp, and on CPU with attention dropout the math path's fp32 scores and
    a bool mask. BLOOM's BloomGelu is a custom autograd Function the partitioner cannot recompute through: its
    compiled layers keep what eager ones do (2 r + 14 p, as ``_layer_bytes``).

    GPT-2's and BLOOM's first traces kept transformers' KV cache on (its default use_cache), whose copies of k and v
    the attention then saved: 2 p more than training, which runs without the cache. The blocks alive at the peak of
    gpt2-medium micro 16 on an H100 showed it first (benchmarks/diag/peak_snapshot.py, *-h100-speed/call2: 4.2 and 3.9
    B/sbh per layer under the cached count, dp and fsdp); traced again without the cache (*-cpu-compiled-no-cache),
    both families keep 2 p fewer, on any device.

    BLOOM's attention bias (compat/bloom_sdpa.py: ALiBi + mask, batch x heads x seq², compute dtype) is built once per
    forward and shared by the layers in eager runs and in one whole-model graph. With one graph per block
    (``per_block``: compile scope 'blocks', or ZeRO-3 and FSDP2 with units of blocks, whose hooks break even a
    whole-model compile at each block: EngineMemory.graphs_per_block) each block builds its own and saves it for
    backward, and none is shared: traced on this CPU with FSDP2 per block on one gloo rank and the model compiled
    whole, 44.4 s·b·h bytes per layer against 32.4 as one graph (one bf16 bias). FSDP2's one unit on one rank leaves
    one graph: bloom-1b7 fsdp --compile on one H200 peaked at its eager figure (*-h200x2-units). bloom-7b1 fsdp
    --compile micro 8, no checkpointing, two H200s (benchmarks/results/*-h200x2-scaling, call 6): 92.82 GiB measured,
    planned 83.13 with the cached count and a shared bias, 93.88 now. Llama's count is unchanged (llama-2-13b the same
    way: 101.94 GiB measured, 101.90 planned); bloom-7b1 zero3 --compile the same way: 107.53 GiB measured, 107.50
    planned (*-h200x2-scaling-bars). The peak moment counts these the same way as eager ones; tests/test_plan_compiled.py
    traces a shape the fit never saw."""
    if not compiled_layers_modelled(arch):  # not traced: the eager count is the safe side
        return _layer_bytes(arch, mode, device)
    p = 4 if mode == "fp32" else 2
    r = 2 if mode == "lp" else 4
    f = arch.ffn / arch.hidden
    kv = arch.kv_heads / arch.heads
    c_p = 4 + 2 * kv + 3 * f if arch.family == "llama" else 6 + 2 * f
    per_sbh = 2 * r + c_p * p
    if arch.resid_dropout > 0:
        per_sbh += 2  # 1-byte bool masks of the two residual dropouts
    per_sb = 2 * 2 * 4 if arch.family != "llama" else 2 * 4  # the norms' fp32 statistics
    fused = arch.attn_impl in ("sdpa", "flash_attention_2")
    per_as2b = 0.0
    if fused and device == "cpu" and arch.attn_dropout > 0:
        per_as2b = 4.0 + 1.0  # CPU SDPA with dropout takes the math path: fp32 scores + bool mask
    elif fused:
        per_sb += 4 * arch.heads  # fp32 log-sum-exp per row and head
    else:  # eager attention inside the graph: the softmax output (fp32 under autocast) and a bool dropout mask
        per_as2b = (4 if mode != "lp" else p) + (1.0 if arch.attn_dropout > 0 else 0.0)
    if per_block:  # BLOOM's SDPA bias, built and saved by each block's graph (see the docstring)
        per_as2b += _shared_bias_bytes(arch, mode)
    return per_sbh, per_as2b, per_sb


def layer_backward_bytes(arch: Arch, mode: str) -> float:
    """Temporaries of one decoder layer's backward beyond what it saved, per s·b·h: the MLP activation's
    gradient is computed through ffn-wide intermediates. Measured on CPU in fp32 (tests/test_plan_pipeline.py):
    GPT-2's composite gelu_new backward keeps 2 ffn-wide tensors at its peak, BLOOM's hand-written
    bloom_gelu_back 5 (tanh_out, ff and their products). Llama-style and others: 2, not measured.
    The loss' 8·b·s·V at the LM head is far larger, so only the pipeline's stages without the head use it."""
    p = 4 if mode == "fp32" else 2
    f = arch.ffn / arch.hidden
    return (5 if arch.family == "bloom" else 2) * f * p


def weight_grad_input_bytes(arch: Arch, mode: str) -> float:
    """Bytes per s·b·h one decoder layer holds from its input gradient (I) to its weight gradient (W) under a split
    backward (zbv), beyond its saved activations (which torch keeps for the W too: stage_backward_input runs with
    retain_graph): the gradient at the output of every op that consumes a weight, captured for the W
    (torch.distributed.pipelining._backward.stage_backward_input's param_groups "grads"). Matmul outputs are in the
    compute dtype, norm outputs in the residual stream's (fp32 under autocast). GPT-2 and BLOOM: qkv 3h, attention
    out h, MLP up ffn, down h, two LayerNorms h each; Llama-style: q h, k and v kv·h each, o h, gate and up ffn each,
    down h, two RMSNorm weights h each; others as GPT-2."""
    p = 4 if mode == "fp32" else 2
    r = 2 if mode == "lp" else 4
    f = arch.ffn / arch.hidden
    if arch.family == "llama":
        kv = arch.kv_heads / arch.heads
        return p * (3 + 2 * kv + 2 * f) + 2 * r
    return p * (5 + f) + 2 * r


def input_grad_backward_bytes(arch: Arch, mode: str) -> float:
    """Temporaries of one decoder layer's input-gradient backward (zbv's I) beyond what it saved and the weights'
    output gradients it keeps (``weight_grad_input_bytes``), per s·b·h. The I runs with retain_graph, so no saved
    tensor is freed along the way to make room, as a full backward's are: besides the MLP's ffn-wide temporaries
    (``layer_backward_bytes``) the attention's q, k and v gradients and their concatenation (6 h) are alive at
    once. GPT-2 fp32 on CPU: 96 bytes per s·b·h element above the layer's start at its peak (44 held for the W +
    52), measured in a 2-rank zbv step (tests/test_plan_pipeline.py's zbv case)."""
    p = 4 if mode == "fp32" else 2
    return layer_backward_bytes(arch, mode) + 6 * p


def _shared_bias_bytes(arch: Arch, mode: str) -> float:
    """Bytes per a·s²·b kept once per forward, not per layer: BLOOM's 'sdpa' (shardlab.compat.bloom_sdpa) passes
    SDPA one ALiBi + causal bias of shape (batch, heads, seq, seq) in the compute dtype, shared by all
    layers and saved by each layer's attention for the backward (the same storage). Kept also under
    activation checkpointing: the bias is memoised on the mask, which the checkpoints hold as an input."""
    if arch.family == "bloom" and arch.attn_impl == "sdpa":
        return 4 if mode == "fp32" else 2
    return 0.0


def _embed_final_bytes(arch: Arch, mode: str, device: str) -> float:
    """Saved bytes per s·b·h outside the layers (embedding dropout / norm, final norm, LM head input)."""
    return embed_bytes(arch, mode, device) + final_bytes(arch, mode, device)


def embed_bytes(arch: Arch, mode: str, device: str) -> float:
    """Saved bytes per s·b·h of the embedding (first pipeline stage): GPT-2's dropout mask, BLOOM's LayerNorm input."""
    p = 4 if mode == "fp32" else 2
    r = 2 if mode == "lp" else 4
    mask = (1 if device == "cuda" else p)
    if arch.family == "gpt2":
        return mask if arch.embd_dropout > 0 else 0
    if arch.family == "bloom":
        return r  # word_embeddings_layernorm in
    return 0


def final_bytes(arch: Arch, mode: str, device: str) -> float:
    """Saved bytes per s·b·h of the final norm and the LM head input (last pipeline stage)."""
    p = 4 if mode == "fp32" else 2
    r = 2 if mode == "lp" else 4
    if arch.family == "llama":
        return {"fp32": 12, "lp": 8, "autocast": 10}[mode]  # final RMSNorm as in _layer_bytes
    return r + p  # ln_f in, lm_head in


@dataclass
class Activations:
    layers: float  # saved by all decoder layers at the end of forward
    embed_final: float
    logits_saved: float  # hf: fp32 log-softmax output saved by cross_entropy (4 b s V); compiled: the logits (p b s V)
    logits_peak: float  # start of backward; hf: saved output + its grad + grad wrt logits (12 b s V); compiled: 2 p b s V
    recompute: float  # gradient checkpointing: one layer recomputed during backward
    per_layer: float = 0.0  # saved by one decoder layer (its input only with gradient checkpointing)
    # once the loss' backward is done and the gradient reaches the LM head: hf/compiled, the logits' 16-bit gradient
    # (p b s V; the loss' saved tensors are freed); liger, the two gradients it computed in forward
    logits_grad: float = 0.0

    @property
    def saved_at_forward_end(self) -> float:
        """What autograd holds when forward returns (comparable with saved-tensor hooks)."""
        return self.layers + self.embed_final + self.logits_saved

    @property
    def peak(self) -> float:
        """Activations plus the loss' transient at the start of backward."""
        return self.layers + self.embed_final + self.recompute + self.logits_peak


def _liger_loss_bytes(tokens: int, h: int, vocab: int, mode: str) -> tuple[float, float]:
    """Liger's fused linear cross-entropy (loss_kernel=liger, training.loss.HeadFusedLoss): no logits tensor.

    In 16-bit runs the hidden states and the head weight go in cast once to 16 bits (autocast: a 2 V h copy of the
    fp32 weight). The kernel computes the gradients in forward: the weight's accumulated in fp32 (4 V h), then cast
    to the weight's dtype (2 V h, both alive at that moment), the hidden states' (tokens x h); one chunk of logits at a
    time (the next power of two of tokens / ceil(V / (C h)) rows, C = loss.CHUNK_MEM_CONST). The two gradients are held
    until backward. Returns (held at the end of forward, the loss' peak, inside its forward)."""
    from ..training.loss import CHUNK_MEM_CONST as LIGER_CHUNK_MEM_CONST  # lazy: training.loss imports torch; this module stays torch-free

    p = 4 if mode == "fp32" else 2
    saved = p * tokens * h + p * vocab * h
    weight_copy = 2.0 * vocab * h if mode == "autocast" else 0.0
    accumulate = 4.0 * vocab * h if mode != "fp32" else 0.0  # fp32 weights: the accumulator is the gradient itself
    chunk = min(tokens, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(vocab / (LIGER_CHUNK_MEM_CONST * h))))))))
    return saved, saved + weight_copy + accumulate + p * chunk * vocab


def frozen_layer_bytes(arch: Arch, mode: str) -> tuple[float, float]:
    """What ``_layer_bytes`` counts (per s·b·h) that a frozen decoder layer does not keep for itself, as
    (linear inputs, norm inputs): the inputs kept only by the linear layers for their weights' gradients (one per
    distinct input: q, k and v share theirs), and the 16-bit normalised values a norm keeps only for its weight's
    gradient (Llama's RMSNorm multiplies by its weight last; a LayerNorm keeps its input either way). The attention
    output that the out-projection reads stays: the fused attention keeps it for its own backward."""
    p = 4 if mode == "fp32" else 2
    f = arch.ffn / arch.hidden
    if arch.family == "llama":  # q/k/v in, gate/up in, down in; two RMSNorms
        return p * (1 + 1 + f), (2 * p if mode != "autocast" else 0.0)
    if arch.family == "gpt2":  # c_attn in, c_fc in, mlp c_proj in (gelu keeps its own input, not its output)
        return p * (1 + 1 + f), 0.0
    if arch.family == "bloom":  # query_key_value in, dense in (a merged-heads copy), h_to_4h in, 4h_to_h in
        return p * (1 + 1 + 1 + f), 0.0
    return 0.0, 0.0


def activation_bytes(arch: Arch, micro: int, seq: int, mode: str, device: str = "cuda", checkpointing: bool = False,
                     loss_kernel: str = "hf", compiled: bool = False, per_block: bool = False) -> Activations:
    """Activation memory of one micro-batch; ``compiled``: the decoder layers as torch.compile saves them
    (``_compiled_layer_bytes``; ``per_block``: one graph per block), the embedding, final norm and loss as counted for
    eager runs."""
    b, s, h, a = micro, seq, arch.hidden, arch.heads
    per_block = compiled and per_block and compiled_layers_modelled(arch)
    if compiled:
        per_sbh, per_as2b, per_sb = _compiled_layer_bytes(arch, mode, device, per_block)
    else:
        per_sbh, per_as2b, per_sb = _layer_bytes(arch, mode, device)
    one_layer = per_sbh * s * b * h + per_as2b * a * s * s * b + per_sb * s * b
    r = 2 if mode == "lp" else 4
    if checkpointing:  # HF checkpoints each decoder layer (non-reentrant): only its input is kept
        layers = arch.layers * r * s * b * h
        recompute = one_layer
    else:
        layers = arch.layers * one_layer
        recompute = 0.0
    bsv = b * s * arch.vocab
    p = 4 if mode == "fp32" else 2
    logits_grad = p * bsv
    if loss_kernel == "compiled":  # shardlab.training.loss: the fused kernel keeps the logits, then their gradient, same dtype
        logits_saved, logits_peak = p * bsv, 2.0 * p * bsv
    elif loss_kernel == "liger":
        logits_saved, logits_peak = _liger_loss_bytes(b * s, h, arch.vocab, mode)
        logits_grad = logits_saved
    else:
        logits_saved, logits_peak = 4.0 * bsv, 12.0 * bsv
    return Activations(
        layers=layers,
        embed_final=_embed_final_bytes(arch, mode, device) * s * b * h + (0 if per_block else _shared_bias_bytes(arch, mode)) * a * s * s * b,
        logits_saved=logits_saved,
        logits_peak=logits_peak,
        recompute=recompute,
        per_layer=layers / arch.layers if arch.layers else 0.0,
        logits_grad=logits_grad,
    )


# --------------------------------------------------------------------------------------------------
# One strategy's prediction


@dataclass
class StrategyPlan:
    strategy: str
    gpu: dict[str, float]  # bytes per GPU by component (parameters, gradients, optimizer, activations, temporary, overhead)
    gpu_peak: float  # predicted max_memory_allocated per GPU
    peak_moment: str
    cpu_per_node: float
    cpu_detail: dict[str, float]
    nvme_per_node: float
    model_state_bytes_per_param: float  # shardlab's parameters+gradients+optimizer states per GPU / n_params
    paper_bytes_per_param: float | None
    deepspeed_gpu: float | None  # DeepSpeed estimator, bytes per GPU (model states only)
    deepspeed_cpu: float | None
    fits: bool = False
    headroom: float = 0.0  # bytes of GPU memory left after peak, context and fragmentation allowance
    why: str = ""
    max_micro_batch: int = 0
    # the batch shape it was planned at: the run's, or under `--micro-batch auto` this strategy's own largest that fits
    micro_batch: int = 0
    grad_accum: int = 0
    notes: list[str] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)  # pipeline: one entry per GPU of a pipeline
    # every moment of a step the plan weighed (bytes per GPU; the largest is gpu_peak); a pipeline's are in ``stages``
    moments: dict[str, float] = field(default_factory=dict)
    # host per node of a --compile run whose graphs are all in inductor's cache (its workers compile nothing); None
    # where no compile pool runs
    cpu_per_node_cached: float | None = None
