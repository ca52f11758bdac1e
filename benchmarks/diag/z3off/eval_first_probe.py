"""ZeRO-3 (param + optimizer offload to CPU): which parameters are still gathered at the start of backward, with and
without a forward-only eval before the first training micro-batch. CPU only (DS_ACCELERATOR=cpu, gloo).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 benchmarks/diag/z3off/eval_first_probe.py [--eval-first] [--fix]
        [--layers 8] [--hidden 64] [--vocab 2048] [--reuse N] [--prefetch N] [--persist N] [--live N] [--micro 6]
        [--checkpointing] [--outside-loss] [--final-eval] [--fix | --fix-reset]  (PROBE_WHY=1, PROBE_TRACE=1: more logs)

A tiny BLOOM (tied embedding, like bloom-7b1) under deepspeed.initialize with the zero_optimization section shardlab's
zero3_offload writes (`shardlab train --dry-run`), thresholds scaled to the tiny model. The probe is a tensor hook on the
(wrapped) loss: it fires when backward starts, before any module's backward (the start of backward), and counts
the non-persistent parameter elements whose ds_status is AVAILABLE, per module. It also prints the coordinator's trace
state and the hit/miss counts of the lru_cache on PartitionedParameterCoordinator.__params_to_release.

--fix clears that lru_cache after training micro-batch 1; --fix-reset clears it whenever reset_step completes a newly
recorded trace (the generic remedy). Findings (deepspeed 0.19.8, 8 layers, hidden 64, vocab 2048, 2 gloo ranks, thresholds
scaled as 7b1's: --live 127139 --checkpointing --outside-loss): non-persistent elements AVAILABLE at the start of backward,
micro-batches 1..5: no eval 0, 131072 (the tied embedding), 131072, 131072, 131072; eval first 0, 0, 0, 0, 0 (the
embedding is released at the end of forward and re-gathered by the root's pre-backward prefetch after the loss'
backward); eval first with either fix: 0, 0, 131072, 131072, 131072. Cause: __params_to_release is
functools.lru_cache'd on (self, submodule, step_id) and never cleared, so training micro-batch 1, which runs its forward
on the eval's forward-only trace, fixes every forward release decision for the rest of the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC  # noqa: E402
from transformers import BloomConfig, BloomForCausalLM  # noqa: E402

P2R = PPC._PartitionedParameterCoordinator__params_to_release  # the lru_cache'd method (name-mangled), under @instrument_w_nvtx
while not hasattr(P2R, "cache_info"):  # instrument_w_nvtx has no functools.wraps: the function is in its closure
    P2R = next(c.cell_contents for c in P2R.__closure__ if callable(c.cell_contents))


def gathered(model, detail=True) -> tuple[int, dict[str, int]]:
    per = collections.Counter()
    for name, p in model.named_parameters():
        if getattr(p, "ds_persist", False):
            continue
        if p.ds_status == ZeroParamStatus.AVAILABLE:
            per[name.rsplit(".", 1)[0]] += p.ds_numel
        elif p.ds_status == ZeroParamStatus.INFLIGHT:
            per[name.rsplit(".", 1)[0] + " (inflight)"] += p.ds_numel
    return sum(per.values()), dict(per)


def explain_releases(coord, mod, rank) -> None:
    """Log every forward release decision under a complete trace: which of the module's parameters were kept, and
    whether the reuse window or the prefetch mark (__most_recent_step_id_param_fetched_for > step) kept them."""
    names = {m: n.replace("transformer.", "") or "<root>" for n, m in mod.named_modules()}
    orig = PPC.release_sub_module
    C = "_PartitionedParameterCoordinator__"

    def release(self, submodule, forward=False):
        if forward and self.is_complete_trace() and rank == 0:
            step = getattr(self, C + "step_id")
            marks = getattr(self, C + "most_recent_step_id_param_fetched_for")
            rel = getattr(self, C + "params_to_release")(submodule, step)
            own = [p for p in submodule.parameters(recurse=False) if not p.ds_persist]
            kept = [p for p in own if p.ds_id not in rel]
            if own:
                why = ["mark %d" % marks[p] if marks[p] > step else "window" for p in kept]
                print(f"WHY step {step} {names[submodule]}: kept {sum(p.ds_numel for p in kept)} of "
                      f"{sum(p.ds_numel for p in own)} ({', '.join(why) or '-'})", flush=True)
        return orig(self, submodule, forward)

    PPC.release_sub_module = release


def main() -> None:  # noqa: C901 - a one-off GPU probe, kept as it was run
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-first", action="store_true")
    ap.add_argument("--eval-batches", type=int, default=1)
    ap.add_argument("--fix", action="store_true",
                    help="clear __params_to_release's lru_cache after micro-batch 1 (the one that ran on the eval's trace)")
    ap.add_argument("--fix-reset", action="store_true",
                    help="generic remedy: clear that cache whenever reset_step completes a newly recorded trace")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="training micro-batches (accumulation 1)")
    ap.add_argument("--reuse", type=int, default=None, help="stage3_max_reuse_distance (default: 0.97 x embedding)")
    ap.add_argument("--prefetch", type=int, default=None, help="stage3_prefetch_bucket_size (default 0.9 hidden^2)")
    ap.add_argument("--persist", type=int, default=None, help="stage3_param_persistence_threshold (default 10 hidden)")
    ap.add_argument("--live", type=int, default=1_000_000_000)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--final-eval", action="store_true")
    ap.add_argument("--outside-loss", action="store_true",
                    help="the model returns logits, the loss is computed outside it (shardlab with a loss_fn)")
    a = ap.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    h = a.hidden
    reuse = a.reuse if a.reuse is not None else int(0.97 * a.vocab * h)  # bloom-7b1: 1e9 = 0.97 x its embedding
    zero = {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": h * h, "allgather_bucket_size": h * h, "sub_group_size": 100_000_000,
        "stage3_prefetch_bucket_size": a.prefetch if a.prefetch is not None else int(0.9 * h * h),
        "stage3_param_persistence_threshold": a.persist if a.persist is not None else 10 * h,
        "stage3_max_live_parameters": a.live, "stage3_max_reuse_distance": reuse,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    }
    ds = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
          "train_batch_size": a.micro * dist.get_world_size(), "gradient_clipping": 1.0, "zero_optimization": zero,
          "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds, remote_device="cpu"):
        model = BloomForCausalLM(BloomConfig(n_layer=a.layers, hidden_size=h, n_head=4, vocab_size=a.vocab))
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    coord = engine.optimizer.parameter_offload.get_param_coordinator()
    mod = engine.module
    emb = mod.transformer.word_embeddings.weight.ds_numel
    blk = sum(p.ds_numel for p in mod.transformer.h[0].parameters())
    if rank == 0:
        print("CONFIG", json.dumps({k: zero[k] for k in zero if k.startswith("stage3")}),
              f"embedding {emb} block {blk} total {sum(p.ds_numel for p in mod.parameters())}", flush=True)

    def state(tag: str) -> None:
        if rank:
            return
        mode = coord._PartitionedParameterCoordinator__trace_mode.name
        order = coord._PartitionedParameterCoordinator__submodule_order
        ci = P2R.cache_info()
        print(f"  {tag}: trace {mode}, {len(order)} modules in trace, params_to_release cache "
              f"hits {ci.hits} misses {ci.misses} size {ci.currsize}", flush=True)

    g = torch.Generator().manual_seed(1)
    at_logits_grad = {}

    def lm_head_out(module, inputs, output):  # registered after DeepSpeed's: `output` is its wrapped logits
        if torch.is_grad_enabled() and output.requires_grad:
            def h(grad):
                at_logits_grad["n"], at_logits_grad["per"] = gathered(mod)
                return grad
            output.register_hook(h)

    mod.lm_head.register_forward_hook(lm_head_out)

    def batch():
        ids = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g)
        return ids

    results = []

    def eval_pass(tag):
        engine.eval()
        with torch.no_grad():
            for _ in range(a.eval_batches):
                engine(input_ids=batch())
        n, per = gathered(mod)
        if rank == 0:
            print(f"{tag}: after the eval forward, gathered {n}: {per}", flush=True)
        state(tag)
        engine.train()

    if a.eval_first:
        eval_pass("eval")
    if a.fix_reset:
        orig_reset = PPC.reset_step

        def reset_step(self):
            recording = self.is_record_trace()
            orig_reset(self)
            if recording and self.is_complete_trace():  # a new trace: the cached release sets were the old trace's
                P2R.cache_clear()

        PPC.reset_step = reset_step
    if os.environ.get("PROBE_WHY"):
        explain_releases(coord, mod, rank)
    for step in range(a.steps):
        if a.fix and step == 1:  # micro-batch 1 ran its forward on the eval's (forward-only) trace: drop those answers
            P2R.cache_clear()
        ids = batch()
        if a.outside_loss:
            out = engine(input_ids=ids)
            logits = out.logits  # DeepSpeed's root wrapper is on this tensor now: its pre-backward runs after the loss'
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        else:
            out = engine(input_ids=ids, labels=ids)
            loss = out.loss
        seen = {}

        def hook(grad, seen=seen):
            seen["n"], seen["per"] = gathered(mod)
            return grad

        loss.register_hook(hook)  # DeepSpeed wraps the outputs: with labels, out.logits is off the loss' path
        engine.backward(loss)
        engine.step()
        results.append((seen.get("n"), at_logits_grad.get("n")))
        if rank == 0:
            print(f"micro-batch {step + 1}: start of backward, gathered {seen['n']} "
                  f"({seen['n'] / emb:.2f} embeddings, {seen['n'] / blk:.2f} blocks): {seen['per']}", flush=True)
            print(f"micro-batch {step + 1}: logits' gradient ready (loss backward done, before lm_head's backward), "
                  f"gathered {at_logits_grad['n']}: {at_logits_grad['per']}", flush=True)
        state(f"after micro-batch {step + 1}")
    if rank == 0 and os.environ.get("PROBE_TRACE"):
        names = {m: n or "<root>" for n, m in mod.named_modules()}
        order = coord._PartitionedParameterCoordinator__submodule_order
        print("TRACE", " ".join(f"{i}:{names.get(m, '?').replace('transformer.', '')}" for i, m in enumerate(order)), flush=True)
    if a.final_eval:
        eval_pass("final eval")
    if rank == 0:
        print("RESULT", json.dumps({"eval_first": a.eval_first, "fix": a.fix, "counts": results}), flush=True)


if __name__ == "__main__":
    main()
