"""Bytes that autograd saves per decoder layer, eager and under torch.compile, counted on the CPU.

`python benchmarks/compiled_activations.py FAMILY MODE DROPOUT [--hidden H --heads A --kv-heads K --ffn F --graphs G]`
prints one JSON line: per layer, in units of s*b*h bytes, for eager and compiled stacks of 2 and 4 layers (the
difference over two layers is one layer; the rest is outside the layers). MODE: fp32 (fp32 weights), autocast (fp32
weights under bf16 autocast), lp (bf16 weights). Parameters and their autocast copies are left out (the planner counts
them apart). GRAPHS: model (one graph of the whole stack, the default), blocks (each block compiled in place, as
compile_scope blocks does), fsdp (FSDP2's fully_shard per block and on the model, one gloo rank, the model compiled
whole, as strategies/fsdp.py does).
planning/memory.py::_compiled_layer_bytes is fitted to these counts; tests/test_plan_compiled.py checks it on a shape
the fit never saw. BLOOM runs with shardlab's SDPA attention (compat/bloom_sdpa.py), as `shardlab train` builds it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

from shardlab.compat.bloom_sdpa import use_sdpa_attention
from shardlab.training.models import transformer_blocks

BATCH, SEQ = 3, 96


def hf_config(family: str, layers: int, dropout: float, hidden: int, heads: int, kv_heads: int, ffn: int):
    if family == "gpt2":  # attention dropout 0: CPU SDPA with dropout takes the math path (counted apart by the planner)
        return transformers.GPT2Config(n_embd=hidden, n_head=heads, n_layer=layers, n_inner=ffn, vocab_size=500,
                                       n_positions=256, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0)
    if family == "bloom":
        return transformers.BloomConfig(hidden_size=hidden, n_head=heads, n_layer=layers, vocab_size=500,
                                        hidden_dropout=dropout, attention_dropout=0.0)
    return transformers.LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    num_hidden_layers=layers, intermediate_size=ffn, vocab_size=500, attention_dropout=0.0)


def build(config, mode: str):
    torch.manual_seed(0)
    bloom = isinstance(config, transformers.BloomConfig)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager" if bloom else "sdpa")
    if bloom:
        use_sdpa_attention(model)
    if mode == "lp":
        model = model.to(torch.bfloat16)
    return model.train()


def _shard(model) -> None:
    """FSDP2 on one CPU rank (gloo), bf16 compute where the weights are bf16: every block, then the whole model (the
    root), as strategies/fsdp.py shards it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=next(model.parameters()).dtype)
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def saved_bytes(model, hidden: int, mode: str, compiled: bool, graphs: str = "model", backend: str = "inductor") -> int:
    body = model.get_decoder()
    numels = {p.numel() for p in model.parameters()}  # before sharding: FSDP2's unsharded copies have these sizes
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    fn = lambda x: body(inputs_embeds=x, use_cache=False).last_hidden_state  # noqa: E731  (no KV cache, as in training)
    if compiled:  # a fresh compile each time: runs in one process share code objects, and dynamo's recompile limit
        torch._dynamo.reset()
    if compiled and graphs == "fsdp":  # the whole model compiled, as strategies/fsdp.py does: its head is counted outside
        _shard(model)
        whole = torch.compile(model, backend=backend)
        fn = lambda x: whole(inputs_embeds=x, use_cache=False).logits  # noqa: E731
    elif compiled and graphs == "blocks":
        for block in transformer_blocks(model):
            block.compile(backend=backend)
    elif compiled:
        fn = torch.compile(fn, backend=backend)
    for _ in range(2):  # the first call compiles; count the second
        seen: dict[int, tuple[int, int]] = {}

        def pack(t, seen=seen):  # bound now: called within this iteration only
            seen[t.untyped_storage().data_ptr()] = (t.numel(), t.untyped_storage().nbytes())
            return t

        x = torch.randn(BATCH, SEQ, hidden, requires_grad=True, dtype=torch.bfloat16 if mode == "lp" else torch.float32)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
                out = fn(x)
        out.float().sum().backward()
    inputs = {x.untyped_storage().data_ptr()} | params
    return sum(nbytes for ptr, (numel, nbytes) in seen.items() if ptr not in inputs and numel not in numels)


def per_layer(family: str, mode: str, dropout: float, hidden: int = 192, heads: int = 4, kv_heads: int = 2,
              ffn: int = 512, layers: tuple[int, int] = (2, 4), graphs: str = "model", backend: str = "inductor") -> dict:
    """Per layer = the difference of two stacks over their difference in layers; outside = the rest. Stacks of 1 and 2
    layers give the same counts as 2 and 4 (llama autocast at the test's shape: 44.125 compiled, 66.125 eager sbh) in
    ~15% less compile time. ``backend='aot_eager_decomp_partition'`` runs inductor's decompositions and min-cut
    partitioner, which decide what is saved, without its code generation: the same counts at the tests' shapes (llama
    autocast 44.125, BLOOM per-block 44.375 and whole 32.375 sbh) in seconds instead of half a minute."""
    sbh = BATCH * SEQ * hidden
    small, big = layers
    out = {"family": family, "mode": mode, "dropout": dropout, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
           "ffn": ffn, "batch": BATCH, "seq": SEQ, "graphs": graphs, "torch": torch.__version__,
           "transformers": transformers.__version__}
    for compiled in (False, True):
        at_small, at_big = (saved_bytes(build(hf_config(family, n, dropout, hidden, heads, kv_heads, ffn), mode), hidden, mode, compiled,
                                        graphs, backend)
                            for n in (small, big))
        per = (at_big - at_small) / (big - small)
        out["compiled" if compiled else "eager"] = {"per_layer_sbh": per / sbh, "outside_sbh": (at_small - small * per) / sbh}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=("gpt2", "llama", "bloom"))
    ap.add_argument("mode", choices=("fp32", "autocast", "lp"))
    ap.add_argument("dropout", type=float)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--graphs", choices=("model", "blocks", "fsdp"), default="model")
    a = ap.parse_args()
    print(json.dumps(per_layer(a.family, a.mode, a.dropout, a.hidden, a.heads, a.kv_heads, a.ffn, graphs=a.graphs)), flush=True)


if __name__ == "__main__":
    main()
