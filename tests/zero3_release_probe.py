"""For tests/test_zero3_release_cache.py, run as its own process (DeepSpeed's and torch.distributed's global state stay
out of pytest's): which non-persistent parameters ZeRO-3 with CPU offload still holds gathered at the start of
backward, per training micro-batch, with and without a forward-only eval before the first one, without and then with
shardlab's release-cache fix (compat/zero3_release_cache.py). One gloo rank is enough to show it.

    python tests/zero3_release_probe.py   ->  one JSON line {"no_eval": [...], "eval_first": [...],
                                                           "eval_first_fixed": [...], "no_eval_fixed": [...], "applied": bool}

A trimmed benchmarks/diag/z3off/eval_first_probe.py (its findings are the reference): a tiny BLOOM (tied embedding)
under the zero_optimization section shardlab's zero3_offload writes, thresholds scaled to the tiny model as for
bloom-7b1 (reuse distance 0.97 x the embedding, max live 127139, activation checkpointing, the loss taken outside the
model). Without an eval the tied embedding (vocab x hidden elements) is still gathered at the start of backward from
micro-batch 2 on; DeepSpeed without the fix keeps the eval trace's decision (released) for the whole run; with the fix
it is gathered again from micro-batch 3 on (micro-batch 2 still records the training trace).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
    os.environ.setdefault(key, value)
if "MASTER_PORT" not in os.environ:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from transformers import BloomConfig, BloomForCausalLM  # noqa: E402

from shardlab.compat.zero3_release_cache import apply_release_cache_fix  # noqa: E402

LAYERS, HIDDEN, VOCAB, SEQ, MICRO, STEPS = 4, 64, 2048, 32, 2, 4


def ds_config() -> dict:
    h = HIDDEN
    zero = {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": h * h, "allgather_bucket_size": h * h, "sub_group_size": 100_000_000,
        "stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h,
        "stage3_max_live_parameters": 127139, "stage3_max_reuse_distance": int(0.97 * VOCAB * h),
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    }
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "train_batch_size": MICRO,
            "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def gathered(model) -> int:
    return sum(p.ds_numel for p in model.parameters()
               if not getattr(p, "ds_persist", False) and p.ds_status == ZeroParamStatus.AVAILABLE)


def run(eval_first: bool) -> list[int]:
    """Non-persistent elements gathered at the start of backward, one count per training micro-batch."""
    ds = ds_config()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds, remote_device="cpu"):
        model = BloomForCausalLM(BloomConfig(n_layer=LAYERS, hidden_size=HIDDEN, n_head=4, vocab_size=VOCAB))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    g = torch.Generator().manual_seed(1)
    if eval_first:
        engine.eval()
        with torch.no_grad():
            engine(input_ids=torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
        engine.train()
    counts = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        logits = engine(input_ids=ids).logits  # the loss outside the model, as shardlab's loss_fn takes it
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        seen = []
        # fires when backward starts, before any module's backward hook
        loss.register_hook(lambda grad, seen=seen: seen.append(gathered(engine.module)) or grad)
        engine.backward(loss)
        engine.step()
        counts.append(seen[0])
    engine.destroy()
    return counts


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"no_eval": run(False), "eval_first": run(True)}
    out["applied"] = apply_release_cache_fix(lambda m: print(m, file=sys.stderr))
    out["eval_first_fixed"] = run(True)
    out["no_eval_fixed"] = run(False)
    out["embedding"] = VOCAB * HIDDEN
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
