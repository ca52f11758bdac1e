"""`pipeline`: pipeline parallelism through torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B, zero-bubble V).

Why torch's pipelining and not DeepSpeed's PipelineModule: it runs the HF model's own modules (no rewrite
into LayerSpecs), and its schedules are the ones `shardlab pipeline simulate` is checked against.

Each rank builds the whole model (same seed, so the same weights everywhere), keeps the contiguous slice
of decoder blocks that the balanced split gives it (plus the embedding on the first stage, the final norm
and LM head on the last) and moves only that slice to its device. One optimizer step = one schedule step
over `grad_accum` micro-batches, so `--microbatches M` is the gradient accumulation.

Tied input/output embeddings (GPT-2, BLOOM, SmolLM2, Llama 3.2, Qwen2.5-0.5B) live on two ranks here; their gradients are summed between
the first and the last stage before the optimizer step, which keeps the two copies identical, exactly as
a tied weight would be (the same thing Megatron-LM does for its embedding group).

zbv (torch's ScheduleZBVZeroBubble) cuts the model into 2 stages per rank placed in a V (rank r runs stages
r and 2P-1-r: layout.ParallelLayout.stages_of, pipesim's placement) and splits each backward into the input
gradient (I), which the previous stage waits for, and the weight gradient (W), which fills bubbles. The first
and the last stage then share rank 0, so a tied embedding is one Parameter in two of its stages: torch would
divide its gradient by M once per stage, so such a rank scales its gradients itself, once per parameter.

Checkpoints are dp's: torch.distributed.checkpoint, every stage's tensors and AdamW state under the names
they have in the unsplit HF model (`hf_names`), so a pipeline checkpoint resumes as dp or fsdp, as a pipeline
of another split, and exports like dp's; a dp or fsdp checkpoint resumes as a pipeline.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from ..compat.stage_timer import time_stages
from ..measure import metrics
from ..training import attention_backend, optim
from ..errors import UserError
from ..layout import ParallelLayout, model_family
from .base import summed
from .torch_optim import TorchOptimizerStrategy, check_checkpointable
from ..pipesim import simulate

# Lazy imports below: torch.distributed.pipelining/checkpoint and transformers' model modules load only when a
# pipeline is built, saved or loaded (the planner imports this module for the stage split).

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")


def zbv_schedule_class():
    """torch's ScheduleZBVZeroBubble, or None on a torch without it (the launcher refuses zbv there in one line)."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, "ScheduleZBVZeroBubble", None)


# ---- splitting the model --------------------------------------------------------------------------------


def stage_costs(n_layers: int, layer_cost: float, head_cost: float, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges for `n_stages`, minimising the slowest stage's cost.

    The LM head (vocab x hidden matmul) sits on the last stage and costs `head_cost` layer-equivalents:
    for BLOOM's 250k vocabulary that is ~20 layers of bloom-560m, so the last stage gets few blocks.
    """
    if n_stages > n_layers:  # an internal invariant: ParallelLayout.from_config refuses such a shape for the user first
        raise ValueError(f"{n_stages} pipeline stages but the model has only {n_layers} layers")
    # Dynamic programme over split points: cost(s, i) = minimal max-stage cost of layers [0, i) in s stages.
    inf = float("inf")
    cost = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    cost[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n_layers + 1):
            for j in range(s - 1, i):
                extra = head_cost if (s == n_stages and i == n_layers) else 0.0
                c = max(cost[s - 1][j], (i - j) * layer_cost + extra)
                if c < cost[s][i]:
                    cost[s][i], choice[s][i] = c, j
    bounds, i = [], n_layers
    for s in range(n_stages, 0, -1):
        j = choice[s][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def model_parts(model: nn.Module):
    """(family, trunk, decoder blocks, final norm, lm head) of a GPT-2, BLOOM or Llama-style model
    (Llama, Qwen2, Mistral, SmolLM: ``model.model`` with embed_tokens, layers, norm and rotary_emb)."""
    if hasattr(model, "transformer") and hasattr(model.transformer, "wpe"):
        t = model.transformer
        return "gpt2", t, list(t.h), t.ln_f, model.lm_head
    if hasattr(model, "transformer") and hasattr(model.transformer, "word_embeddings_layernorm"):
        t = model.transformer
        return "bloom", t, list(t.h), t.ln_f, model.lm_head
    t = getattr(model, "model", None)
    if all(hasattr(t, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "llama", t, list(t.layers), t.norm, model.lm_head
    raise UserError(f"pipeline parallelism supports GPT-2, BLOOM and Llama-style models, not {type(model).__name__}",
                    "use another strategy")


def embedding_modules(family: str, trunk: nn.Module) -> dict[str, nn.Module]:
    """The first stage's modules before the blocks; the token embedding ('wte') first."""
    if family == "gpt2":
        return {"wte": trunk.wte, "wpe": trunk.wpe, "drop": trunk.drop}
    if family == "bloom":
        return {"wte": trunk.word_embeddings, "ln": trunk.word_embeddings_layernorm}
    return {"wte": trunk.embed_tokens}


class Stage(nn.Module):
    """One pipeline stage of a GPT-2, BLOOM or Llama-style model, built from the HF model's own submodules."""

    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool, autocast_dtype: torch.dtype | None = None,
                 sdpa_backend: str = "auto"):
        super().__init__()
        self.sdpa_backend = sdpa_backend  # RunConfig.sdpa_backend: entered around each forward, as Strategy.forward does
        # bf16: the stage's forward runs under autocast over fp32 master weights, as dp does. The
        # residual stream stays fp32, so what travels between stages is fp32 and shapes/dtypes agree.
        self.autocast_dtype = autocast_dtype
        self.family, trunk, blocks, ln_f, lm_head = model_parts(model)
        self.config = model.config
        self.embed = nn.ModuleDict(embedding_modules(self.family, trunk)) if first else None
        self.blocks = nn.ModuleList(blocks[start:end])
        # Llama: every stage computes the rotary cos/sin itself from the positions (a buffer-only module, no
        # weights), so only the hidden states travel between stages, as for GPT-2 and BLOOM.
        self.rotary_emb = trunk.rotary_emb if self.family == "llama" else None
        self.head = nn.ModuleDict({"ln_f": ln_f, "lm_head": lm_head}) if last else None
        self.num_heads = getattr(model.config, "n_head", None) or getattr(model.config, "num_attention_heads", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = contextlib.nullcontext() if self.autocast_dtype is None else torch.autocast(x.device.type, dtype=self.autocast_dtype)
        with autocast, attention_backend.context(self.sdpa_backend):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            if self.family == "gpt2":
                pos = torch.arange(x.shape[1], device=x.device)
                x = self.embed["drop"](self.embed["wte"](x) + self.embed["wpe"](pos))
            elif self.family == "bloom":
                x = self.embed["ln"](self.embed["wte"](x))
            else:
                x = self.embed["wte"](x)
        if self.family == "bloom" and len(self.blocks):
            x = self._bloom_blocks(x)
        elif self.family == "llama" and len(self.blocks):
            x = self._llama_blocks(x)
        else:
            for block in self.blocks:  # no mask: right-padded or packed data needs only the causal one
                out = block(x)
                x = out[0] if isinstance(out, tuple) else out
        if self.head is not None:
            x = self.head["lm_head"](self.head["ln_f"](x))
        return x

    def _llama_blocks(self, x: torch.Tensor) -> torch.Tensor:
        # What LlamaModel.forward (and Qwen2's, Mistral's) does around its layers: positions 0..s-1, the
        # rotary (cos, sin) passed to every layer as position_embeddings, and the causal mask for the
        # configured attention (None for SDPA, which is then causal by itself); sliding-window layers get theirs.
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(x, position_ids)
        types = getattr(self.config, "layer_types", None)  # Qwen2: per layer; Mistral: none, all sliding if set
        default = "full_attention" if getattr(self.config, "sliding_window", None) is None else "sliding_attention"
        masks = {t: _causal_mask(self.config, x, position_ids, sliding=t == "sliding_attention") for t in set(types or [default])}
        for block in self.blocks:
            kind = types[block.self_attn.layer_idx] if types else default
            out = block(x, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=position_embeddings)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def _bloom_blocks(self, x: torch.Tensor) -> torch.Tensor:
        # BLOOM's blocks need ALiBi biases and the causal mask, which BloomModel.forward builds; same recipe.
        from transformers.models.bloom import modeling_bloom

        batch, seq = x.shape[:2]
        slopes = modeling_bloom._get_alibi_slopes(self.num_heads, x.device)
        alibi = (slopes[:, None, None] * torch.arange(seq, device=x.device)).repeat(batch, 1, 1).to(x.dtype)
        mask = _causal_mask(self.config, x, None)
        for block in self.blocks:
            x = block(x, alibi=alibi, attention_mask=mask)[0]
        return x


def _causal_mask(config, x: torch.Tensor, position_ids: torch.Tensor | None, sliding: bool = False):
    """transformers' causal (or sliding-window) mask for ``config``'s attention, with no cache and no padding.

    The KV-cache argument is named ``cache`` in transformers 5.2x and ``past_key_values`` before (with a
    ``cache_position``); each is passed under the name this version takes."""
    from transformers import masking_utils

    fn = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    params = inspect.signature(fn).parameters
    kwargs = {name: None for name in ("cache", "past_key_values") if name in params}
    if "cache_position" in params:  # older signatures derive the query length from it
        kwargs["cache_position"] = torch.arange(x.shape[1], device=x.device)
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    embeds = "inputs_embeds" if "inputs_embeds" in params else "input_embeds"
    return fn(config=config, attention_mask=None, **{embeds: x}, **kwargs)


# The LM head's matmul is 2*V*h FLOPs per token, but with the fp32 cross-entropy over the vocabulary
# (memory-bound: logits upcast, log-softmax, its backward) the last stage's extra time is about twice
# that: 5.8-6.2 decoder-block equivalents measured for gpt2-large (seq 1024, bf16, 2 and 4 stages on
# H200s) where FLOPs alone give 2.9. Fitted from benchmarks/results/*-h200x4-pipeline/.
HEAD_COST_FACTOR = 2.1


def _layer_and_head_cost(model: nn.Module, seq_len: int) -> tuple[float, float]:
    """Cost per token of one decoder block and of the LM head plus loss, in forward FLOPs
    (backward is about the same multiple of both)."""
    cfg = model.config
    hidden = getattr(cfg, "n_embd", None) or cfg.hidden_size
    vocab = cfg.vocab_size
    heads = getattr(cfg, "n_head", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    ffn = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    gated = model_family(cfg) == "llama"  # Llama-style SwiGLU MLP: gate, up and down matrices
    # Megatron/Narayanan et al. 2021: 2 FLOPs per weight of the matmuls (q and o, k and v with GQA's fewer
    # heads, the MLP's 2 or 3 matrices) + attention; GPT-2/BLOOM: 24h^2 + 4sh.
    matmul_weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + (3 if gated else 2) * hidden * ffn
    layer = 2 * matmul_weights + 4 * seq_len * heads * head_dim
    head = HEAD_COST_FACTOR * 2 * vocab * hidden
    return float(layer), float(head)


def split_blocks(config, n_layers: int, seq_len: int, n_stages: int) -> list[tuple[int, int]]:
    """The [start, end) blocks of every (virtual) stage for an HF ``config``: compute-balanced, the LM head on
    the last stage weighed in layer-equivalents. One function for the strategy and for `shardlab plan`."""
    if n_stages <= 1:
        return [(0, n_layers)]
    layer_cost, head_cost = _layer_and_head_cost(SimpleNamespace(config=config), seq_len)
    return stage_costs(n_layers, 1.0, head_cost / layer_cost, n_stages)


class StepLoss:
    """The last stage's loss of one micro-batch: the loss the HF model itself uses (transformers' ForCausalLMLoss).

    In training, ``items`` is the step's label tokens over all replicas divided by the replica count, so each
    micro-batch's summed token losses over it add up, over the micro-batches (the schedule does not scale them:
    scale_grads=False) and the replicas' averaged gradients, to the step's token-weighted mean, as in
    Strategy.train_step. None (eval): the micro-batch's mean."""

    def __init__(self):
        self.items: float | torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=self.items)


# ---- measuring the stages ---------------------------------------------------------------------------------


class StageTimer:
    """Time spent in each forward and backward of each of this rank's stages, per optimizer step.

    Wraps the PipelineStage's `forward_one_chunk` / `backward_one_chunk` / `backward_weight_one_chunk`
    (compat/stage_timer.py) and the loss, part of the last stage's forward. The schedule waits for its receives before calling them, so their
    time is compute, not waiting. Under zbv `backward_one_chunk` is the input gradient (I) and
    `backward_weight_one_chunk` the weight gradient (W); "B" is their sum, "W" the second part.
    On GPU, CUDA events read once per step (no sync per call).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.active = False
        self._marks: list[tuple[tuple[int, str], object, object]] = []
        self.steps: list[dict[tuple[int, str], float]] = []  # per step: (stage, F / B / W) -> seconds on this rank

    def _now(self):
        if self.cuda:
            evt = torch.cuda.Event(enable_timing=True)
            evt.record()
            return evt
        return time.perf_counter()

    def wrap(self, fn, stage: int, kind: str):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = self._now()
            out = fn(*args, **kwargs)
            self._marks.append(((stage, kind), start, self._now()))
            return out

        return timed

    def end_step(self) -> None:
        totals: dict[tuple[int, str], float] = {}
        if self.cuda and self._marks:
            self._marks[-1][2].synchronize()
        for key, start, end in self._marks:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals[key] = totals.get(key, 0.0) + seconds
            if key[1] == "W":  # a weight gradient is part of its stage's backward
                totals[(key[0], "B")] = totals.get((key[0], "B"), 0.0) + seconds
        self.steps.append(totals)
        self._marks.clear()


def step_clock() -> float:
    """Seconds on CLOCK_MONOTONIC, which every process of one host reads alike, so the ranks' step starts and ends
    compare (perf_counter's reference point is undefined)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def step_clock_id() -> str:
    """Which monotonic clock this process reads: the kernel's boot id (one per host and boot), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def pipeline_step(ranks: list[list[tuple[float, float, float]]], first: int, shared_clock: bool) -> dict:
    """The measured step and bubble as the simulator defines them, from each rank's (start, end, work) per step.

    The step runs from the first stage's rank starting it (every action waits, through the forwards, on that stage's
    first one) to the LAST rank finishing, as the simulator's makespan does. One rank's own start-to-end is not the
    step: under zbv the first stage's rank is done once the last input gradient reaches it, while the middle ranks
    still run their deferred W's. Bubble = 1 - summed work / (ranks x step), the simulator's. Medians over steps;
    on ranks without a shared clock, the slowest rank's own step.
    """
    spans, bubbles, ends = [], [], []
    for step in zip(*ranks):
        start = step[first][0]
        span = max(e for _, e, _ in step) - start if shared_clock else max(e - s for s, e, _ in step)
        if span <= 0:
            continue
        spans.append(span)
        bubbles.append(max(0.0, 1 - sum(w for _, _, w in step) / (len(step) * span)))
        ends.append([e - start for _, e, _ in step])
    if not spans:
        return {"step": float("nan"), "bubble": None, "rank_end": None}
    rank_end = [statistics.median(e[r] for e in ends) for r in range(len(ranks))] if shared_clock else None
    return {"step": statistics.median(spans), "bubble": statistics.median(bubbles), "rank_end": rank_end}


# ---- names: a stage's tensors under the unsplit model's names ------------------------------------------


def hf_names(model: nn.Module, stages: nn.Module) -> dict[str, list[str]]:
    """Each state_dict name of `stages` (a rank's stage modules, built from `model`'s own submodules) -> the
    names the same tensor has in the HF `model`'s state_dict, the first one first (the one named_parameters()
    keeps for a tied weight, and DCP's get_state_dict keys its optimizer state by). E.g. for GPT-2 split 1 + 1
    blocks over 2 stages: '1.blocks.0.attn.c_attn.weight' -> ['transformer.h.1.attn.c_attn.weight'], and the
    last stage's '0.head.lm_head.weight' -> ['transformer.wte.weight', 'lm_head.weight'].

    By identity, not by string rules: the stages hold `model`'s very Parameter objects (module.to keeps them)."""
    aliases: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(t), []).append(name)
    out = {}
    for name, t in stages.state_dict(keep_vars=True).items():
        if id(t) not in aliases:
            raise RuntimeError(f"pipeline stage tensor {name!r} is not a tensor of the model")
        out[name] = aliases[id(t)]
    return out


# ---- the strategy --------------------------------------------------------------------------------------


@functools.cache  # asked on every training step; the answer is torch's, fixed for the process
def step_keeps_outputs() -> bool:
    """Whether `schedule.step` keeps every micro-batch's last-stage output (the logits) until the step ends.

    It does by default, to return them merged; torch versions whose schedules take `return_outputs`
    (pytorch/pytorch#159251) let the caller decline, and then each micro-batch's logits are freed at its
    backward. shardlab declines where it can (nothing reads the merged logits in training).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    return not all("return_outputs" in inspect.signature(c.step).parameters for c in (PipelineScheduleSingle, PipelineScheduleMulti))


class PipelineStrategy(TorchOptimizerStrategy):
    takes_pipeline_options = True

    def build_model(self) -> nn.Module:
        """The whole fp32 model on the CPU: every rank cuts its own stages out of it and moves only those."""
        from ..training.models import build_model

        return build_model(self.cfg)

    @classmethod
    def check_options(cls, run) -> None:
        super().check_options(run)
        cfg = run.cfg
        if run.precision.name == "fp16":
            # A GradScaler per stage would decide on overflow from its own stage's gradients only.
            raise UserError("fp16 is not supported with strategy 'pipeline' (its loss scaling would need every stage to agree on overflow)",
                            "use --precision bf16 (or fp32)")
        opts = cfg.strategy_options
        if opts.pp_schedule == "zbv":
            if zbv_schedule_class() is None:
                raise UserError(f"--schedule zbv needs torch's ScheduleZBVZeroBubble, which torch {torch.__version__} lacks",
                                "use --schedule 1f1b or interleaved-1f1b, or a newer torch")
            if "pp_chunks" in opts.model_fields_set and opts.pp_chunks != 2:
                raise UserError(f"zbv always places 2 stages on each rank, not --chunks {opts.pp_chunks}", "drop --chunks")

    def setup(self, model: nn.Module, total_steps: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        opts, env = self.cfg.strategy_options, self.env
        _, _, blocks, _, _ = model_parts(model)
        # The trainer's layout, from the same config (checked by the launcher's preflight), this schedule's M.
        self.parallel = ParallelLayout.from_config(self.cfg, env.world_size, layers=len(blocks), microbatches=self.grad_accum)
        self.n_ranks = self.parallel.stages  # ranks per pipeline
        self._make_groups()
        self.chunks = self.parallel.chunks
        n_stages = self.parallel.virtual_stages
        bounds = split_blocks(model.config, len(blocks), self.cfg.seq_len, n_stages)
        self.bounds = bounds
        self.full_model = model  # on the CPU; only this rank's stages move to the device
        # Loop-style placement: stage s runs on rank s % ranks (what ScheduleInterleaved1F1B expects); zbv's V:
        # rank r runs stages r and 2R-1-r (what ScheduleZBVZeroBubble expects). The layout knows which.
        my_stages = self.parallel.stages_of(env.rank)
        self.stage_modules = []
        pp_stages = []
        for s in my_stages:
            dtype = self.precision.dtype if optim.autocasts(self.spec, self.cfg, self.precision.name) else None
            module = Stage(model, *bounds[s], first=s == 0, last=s == n_stages - 1, autocast_dtype=dtype,
                           sdpa_backend=self.cfg.sdpa_backend).to(env.device)
            self.stage_modules.append(module)
            pp_stages.append(PipelineStage(module, s, n_stages, env.device, group=self.pp_group))
        self.is_first = 0 in my_stages
        self.is_last = (n_stages - 1) in my_stages
        self.my_stages = my_stages
        # Global rank of this replica's last stage, which computes the loss (rank 0's under zbv).
        self.last_rank = self.pp_ranks[self.parallel.stage_position(n_stages - 1)]
        params = [p for m in self.stage_modules for p in m.parameters()]
        self._owned = {id(p) for p in params}
        self.hf_model = model
        self.model = nn.ModuleList(self.stage_modules)  # this rank's stages: train()/eval() and the optimizer
        self._build_optimizer(self.model, env.device.type, total_steps)
        self.timer = StageTimer(env.device)
        self.schedule_spans: list[tuple[float, float]] = []  # per step: (start, end) on step_clock()
        self.stages_timed = time_stages(zip(my_stages, pp_stages), self.timer.wrap)  # compat/stage_timer.py
        self.step_loss = StepLoss()
        loss_fn = self.timer.wrap(self.step_loss, n_stages - 1, "F") if self.stages_timed else self.step_loss
        # StepLoss already weighs each micro-batch by its share of the step's tokens: no schedule divides by M (a tied
        # parameter held by two of a rank's zbv stages would be divided twice by torch's scale_grads).
        if opts.pp_schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(pp_stages, self.grad_accum, loss_fn=loss_fn, scale_grads=False)
        elif opts.pp_schedule == "zbv":  # check_options refused zbv where torch lacks it
            self.schedule = zbv_schedule_class()(pp_stages, self.grad_accum, loss_fn=loss_fn, scale_grads=False)
        else:
            cls = ScheduleGPipe if opts.pp_schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(pp_stages[0], self.grad_accum, loss_fn=loss_fn, scale_grads=False)
        # Tied embedding: the first and the last stage each hold a copy; their grads are summed.
        self._tied = self._find_tied()
        self._tie_group = None
        if self._tied and self.last_rank != self.pp_ranks[0]:
            last_pos = self.last_rank - self.pp_ranks[0]
            groups = [dist.new_group([r[0], r[last_pos]]) for r in self._all_pp_ranks]  # every rank makes every group
            self._tie_group = groups[self.dp_rank]

    def _make_groups(self) -> None:
        """One process group per pipeline replica and one per pipeline position (layout.py numbers the ranks)."""
        layout, rank = self.parallel, self.env.rank
        self.pp_rank, self.dp_rank, self.dp_size = layout.pp_rank(rank), layout.dp_rank(rank), layout.dp_size
        self._all_pp_ranks = layout.pipeline_groups()
        self.pp_ranks = self._all_pp_ranks[self.dp_rank]
        if self.dp_size == 1:
            self.pp_group = self.dp_group = None  # the default group is the one pipeline
            return
        # torch.distributed requires every rank to create every group, in the same order.
        pp_groups = [dist.new_group(r) for r in self._all_pp_ranks]
        dp_groups = [dist.new_group(r) for r in layout.dp_groups()]
        self.pp_group, self.dp_group = pp_groups[self.dp_rank], dp_groups[self.pp_rank]

    def _average_over_replicas(self) -> None:
        """Data parallelism across pipeline replicas: average each stage's gradients over its replicas.

        One flat all-reduce after the schedule, not DDP: DDP's reducer (torch 2.13) fails an internal
        assert when a pipeline schedule runs several micro-batch backwards per step (the bucket rebuild
        counts every parameter once per micro-batch), and with static_graph=True its gradients came out
        unreduced in our test. FSDP2 over the replica group (torchtitan's way) is the engine route next.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]  # a Parameter once, however many stages hold it
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def _find_tied(self) -> bool:
        family, trunk, _, _, lm_head = model_parts(self.full_model)
        return embedding_modules(family, trunk)["wte"].weight is lm_head.weight

    def _tied_param(self) -> nn.Parameter | None:
        if not self._tied or not (self.is_first or self.is_last):
            return None
        return self.full_model.lm_head.weight  # the same Parameter object as the input embedding

    # ---- one optimizer step -------------------------------------------------------------------------
    def step_label_tokens(self, local: int) -> float | torch.Tensor:
        """The stages of one replica read the same batches: the step's label tokens are summed over the replicas."""
        return summed(local, self.env.device, self.dp_group) if self.dp_group is not None else float(local)

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        """All the step's micro-batches through the schedule at once; returns (this rank's share of the step's
        token-weighted mean loss, non-pad tokens), each counted once per replica, on its first stage."""
        step = next(batches)
        inputs = torch.cat([m.batch["input_ids"] for m in step.micros])
        labels = torch.cat([m.batch["labels"] for m in step.micros])
        losses: list[torch.Tensor] = []
        kwargs = {} if step_keeps_outputs() else {"return_outputs": False}
        if self.is_last:
            kwargs.update(target=labels, losses=losses)
        self.step_loss.items = self.step_label_tokens(step.label_tokens) / self.dp_size
        self.timer.active = True
        metrics.sync(self.env.device)
        t0 = step_clock()
        try:
            if self.is_first:
                self.schedule.step(inputs, **kwargs)
            else:
                self.schedule.step(**kwargs)
        finally:
            self.step_loss.items = None
        metrics.sync(self.env.device)
        self.schedule_spans.append((t0, step_clock()))
        self.timer.active = False
        self.timer.end_step()
        batches.preload()
        # the replica's summed token losses over the step's label tokens, times the replica count (StepLoss)
        total = torch.stack(losses).sum().detach().float() if self.is_last else torch.zeros((), device=self.env.device)
        dist.broadcast(total, src=self.last_rank, group=self.pp_group)  # every stage reports the loss
        first = self.pp_rank == 0
        return (total / self.dp_size if first else torch.zeros_like(total)), (step.useful if first else 0)

    def backward(self, loss: torch.Tensor, last_micro: bool) -> None:  # pragma: no cover - train_step does it
        raise NotImplementedError("the pipeline schedule runs forward and backward together")

    def optimizer_step(self) -> float | None:
        if self.dp_group is not None:
            self._average_over_replicas()
        tied = self._tied_param()
        if self._tie_group is not None and tied is not None and tied.grad is not None:
            dist.all_reduce(tied.grad, group=self._tie_group)
        # Global grad norm over all stages, the tied weight counted once (on the first stage).
        own = [p for p in self.model.parameters() if p.grad is not None]  # a Parameter once, however many stages hold it
        counted = [p for p in own if not (self.is_last and not self.is_first and tied is not None and p is tied)]
        sq = torch.zeros((), device=self.env.device, dtype=torch.float32)
        for p in counted:
            sq += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=self.pp_group)  # replicas hold identical (averaged) grads
        norm = sq.sqrt()
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(own, self.cfg.max_grad_norm, norm)
        self.last_step_skipped = not bool(torch.isfinite(norm))  # non-finite gradients never reach the weights
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def forward(self, batch):
        """Eval only: the loss of one batch of `grad_accum` micro-batches, on every rank."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": batch["labels"], "losses": losses} if self.is_last else {}
        with torch.no_grad():
            if self.is_first:
                self.schedule.eval(batch["input_ids"], **kwargs)
            else:
                self.schedule.eval(**kwargs)
        loss = torch.stack(losses).mean().float() if self.is_last else torch.zeros((), device=self.env.device)
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        return loss

    # ---- measured vs simulated --------------------------------------------------------------------------
    def summary_extras(self) -> dict:
        """Per-stage forward/backward times measured in this run, fed to `shardlab pipeline simulate`,
        next to the measured schedule time and bubble. Collective over the pipeline group.

        stage_fwd_ms / stage_bwd_ms: per rank (all its stages); virtual_stage_*: per virtual stage, what the
        simulator is fed (interleaved and zbv chunks are not equal: the split balances blocks plus head, and
        zbv's first stage has no input gradient); zbv adds each stage's weight-gradient (W) time."""
        steps = list(zip(self.timer.steps, self.schedule_spans))
        steady = steps[metrics.WARMUP_STEPS:] or steps
        M = self.grad_accum
        sched = self.cfg.strategy_options.pp_schedule
        if not self.stages_timed:  # every rank alike: the patch's versions are the same on all
            return {"pipeline": {"schedule": sched, "stages": self.n_ranks, "chunks": self.chunks, "microbatches": M,
                                 "split": self.bounds, "note": "no per-stage times: patch stage_timer is off"}}

        def work(times: dict) -> float:  # this rank's compute in one step ("B" includes zbv's W)
            return sum(v for (_, k), v in times.items() if k in ("F", "B"))

        # This rank's per-stage times of one step (its median-work step), and every step's start, end and work: the
        # step and the bubble come from whole steps across the ranks (pipeline_step), so each step's work lies inside
        # that step however noisy the steps are (separate medians of F, of B and of the step time need not).
        mid = sorted(steady, key=lambda st: work(st[0]))[(len(steady) - 1) // 2][0] if steady else {}
        mine = {"stages": {s: {k: mid.get((s, k), 0.0) / M for k in ("F", "B", "W")} for s in self.my_stages},
                "steps": [(t0, t1, work(f)) for f, (t0, t1) in steady], "clock": step_clock_id()}
        per_rank: list[dict] = [None] * self.n_ranks  # type: ignore[list-item]
        dist.all_gather_object(per_rank, mine, group=self.pp_group)
        stages = {s: t for rank in per_rank for s, t in rank["stages"].items()}
        n_stages = len(stages)
        fwd = [max(stages[s]["F"], 1e-9) for s in range(n_stages)]
        bwd = [max(stages[s]["B"], 1e-9) for s in range(n_stages)]
        split = sched == "zbv"
        wgrad = [min(1.0, stages[s]["W"] / bwd[s]) for s in range(n_stages)] if split else None
        sim = simulate(sched, self.n_ranks, M, fwd=fwd, bwd=bwd, chunks=self.chunks, wgrad=wgrad)
        shared = len({r["clock"] for r in per_rank}) == 1
        first = next(i for i, r in enumerate(per_rank) if 0 in r["stages"])
        measured = pipeline_step([r["steps"] for r in per_rank], first, shared)
        rank_fwd = [sum(fwd[s] for s in self.parallel.stages_of(r)) for r in range(self.n_ranks)]
        rank_bwd = [sum(bwd[s] for s in self.parallel.stages_of(r)) for r in range(self.n_ranks)]
        out = {
            "schedule": sched, "stages": self.n_ranks, "chunks": self.chunks, "microbatches": M, "split": self.bounds,
            "stage_fwd_ms": [1e3 * f for f in rank_fwd], "stage_bwd_ms": [1e3 * b for b in rank_bwd],
            "virtual_stage_fwd_ms": [1e3 * f for f in fwd], "virtual_stage_bwd_ms": [1e3 * b for b in bwd],
            "stages_of_rank": [self.parallel.stages_of(r) for r in range(self.n_ranks)],
            "simulated_step_ms": 1e3 * sim.makespan, "measured_step_ms": 1e3 * measured["step"],
            "simulated_bubble": sim.metrics["bubble_fraction"], "measured_bubble": measured["bubble"],
            # when each rank ends its part of the step (from the step's start): under zbv the first rank ends early
            "simulated_rank_end_ms": [1e3 * max(e.end for e in sim.device_events(d)) for d in range(self.n_ranks)],
            "measured_rank_end_ms": [1e3 * e for e in measured["rank_end"]] if measured["rank_end"] else None,
            "note": "simulated from the measured per-stage times with no communication cost; measured = wall time of "
                    "the schedule's step (p2p and waits included) from the first stage's rank starting it to the last "
                    "rank ending it" + ("" if shared else " (ranks on several hosts: the slowest rank's own step)")
                    + ", warm-up excluded; bubble = 1 - the ranks' work / (ranks x step) in both",
        }
        if split:
            out["virtual_stage_wgrad_ms"] = [1e3 * stages[s]["W"] for s in range(n_stages)]
        return {"pipeline": out}

    # ---- state: DCP under the unsplit model's names (the layout dp and fsdp write) ------------------------
    @functools.cached_property
    def _fqns(self) -> dict[str, list[str]]:
        return hf_names(self.full_model, self.model)

    def _dcp_state(self) -> dict:
        """This rank's model and optimizer state keyed as dp keys the whole model's: each stage's tensors under
        every name they have in the HF model (a tied embedding under both), the optimizer state under the
        parameter's first name, and parameter groups that list every stage's parameters (identical on every
        rank, so DCP writes them once and dp/fsdp match them to their own groups). Collective."""
        check_checkpointable(self.cfg)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        fqns = self._fqns
        model = {hf: t for name, t in model_sd.items() for hf in fqns[name]}
        state = {fqns[name][0]: s for name, s in optim_sd["state"].items()}
        groups = [{**g, "params": [fqns[n][0] for n in g["params"]]} for g in optim_sd["param_groups"]]
        # Every rank's group members, merged by group (weight decay tells optim.param_groups' groups apart)
        # and ordered as in the whole model.
        everyone: list[list] = [None] * self.env.world_size  # type: ignore[list-item]
        dist.all_gather_object(everyone, [(g["weight_decay"], g["params"]) for g in groups])
        order = {n: i for i, n in enumerate(self.full_model.state_dict(keep_vars=True))}
        for g in groups:
            members = {n for rank in everyone for wd, names in rank if wd == g["weight_decay"] for n in names}
            g["params"] = sorted(members, key=order.__getitem__)
        return {"model": model, "optimizer": {"state": state, "param_groups": groups}}

    def _dcp_load(self, path: Path) -> None:
        """Read only this rank's tensors, by their names in the whole model, from a pipeline checkpoint of any
        split or a dp/fsdp one; a tied weight under whichever of its names the checkpoint stores."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # also creates the optimizer state it fills
        fqns = self._fqns

        def stored_name(name: str, keys) -> str:
            found = next((hf for hf in fqns[name] if all(k.format(hf) in stored for k in keys)), None)
            if found is None:
                raise UserError(f"the checkpoint lacks {fqns[name][0]!r} of this model (or its optimizer state)",
                                "resume with the model and optimizer the checkpoint was written with")
            return found

        model_keys = {n: stored_name(n, ["model.{}"]) for n in model_sd}
        state_keys = {n: stored_name(n, [f"optimizer.state.{{}}.{k}" for k in s]) for n, s in optim_sd["state"].items()}
        request = {
            "model": {model_keys[n]: t for n, t in model_sd.items()},
            "optimizer": {"state": {state_keys[n]: s for n, s in optim_sd["state"].items()},
                          "param_groups": [dict(g) for g in optim_sd["param_groups"]]},  # replaced by the stored groups
        }
        dcp.load(request, checkpoint_id=str(path))
        groups = []
        for mine in optim_sd["param_groups"]:  # the stored group that holds this group's parameters gives its settings
            first = fqns[mine["params"][0]][0]
            found = next((g for g in request["optimizer"]["param_groups"] if first in g["params"]), None)
            if found is None:
                raise UserError(f"the checkpoint's optimizer groups do not hold {first!r}", "resume with the settings the checkpoint was written with")
            groups.append({**found, "params": mine["params"]})
        set_state_dict(self.model, self.optimizer,
                       model_state_dict={n: request["model"][model_keys[n]] for n in model_sd},
                       optim_state_dict={"state": {n: request["optimizer"]["state"][state_keys[n]] for n in optim_sd["state"]},
                                         "param_groups": groups})  # fmt: skip

    def full_state_dict(self, trainable_only: bool = False):
        """Each rank contributes the original-name weights it owns; rank 0 assembles them (a pipeline trains no
        adapters: ``trainable_only`` changes nothing)."""
        mine = {
            name: p.detach().cpu()
            for name, p in self.full_model.named_parameters(remove_duplicate=False)
            if id(p) in self._owned
        }
        gathered: list[dict] | None = [None] * self.env.world_size if self.env.is_main else None  # type: ignore[list-item]
        dist.gather_object(mine, gathered, dst=0)
        if not self.env.is_main:
            return None
        out: dict[str, torch.Tensor] = {}
        for part in gathered:  # type: ignore[union-attr]
            for k, v in part.items():
                out.setdefault(k, v)
        return out

    def memory_note(self) -> str:
        first, last = self.bounds[0], self.bounds[-1]
        placed = " in a V (rank r: stages r and 2R-1-r)" if self.parallel.placement == "v" else ""
        return (f"pipeline: {len(self.bounds)} stages over {self.n_ranks} ranks{placed}, blocks split {self.bounds} "
                f"(embedding on stage 0, LM head on the last; first {first[1] - first[0]} / last {last[1] - last[0]} blocks)")
