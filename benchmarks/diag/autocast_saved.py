"""Saved activation bytes per decoder layer under CUDA autocast (dp's bf16 mode) against the planner's count.

Builds 2- and 4-layer GPT-2, BLOOM and Llama stacks of a real width (fp32 weights, as dp keeps them), runs one forward
under torch.autocast(cuda, bf16) with saved-tensor hooks, and prints the per-layer bytes (the 4-layer run minus the
2-layer one, halved) per s*b*h element, measured and planned (planning/memory.activation_bytes, mode 'autocast').

    python3 benchmarks/diag/autocast_saved.py          # a CUDA GPU; prints one line per family
"""

import torch
import transformers
from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig

from shardlab.planning.memory import activation_bytes
from shardlab.planning.arch import arch_from_hf_config

transformers.logging.set_verbosity_error()
SEQ, MICRO = 1024, 2


def saved(model) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 1000, (MICRO, SEQ), device="cuda")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(seen.values())


def config(family: str, layers: int):
    if family == "gpt2":
        return GPT2Config(n_layer=layers, n_embd=1024, n_head=16, vocab_size=1000, resid_pdrop=0, attn_pdrop=0, embd_pdrop=0), "sdpa"
    if family == "bloom":
        return BloomConfig(n_layer=layers, hidden_size=1024, n_head=16, vocab_size=1000, hidden_dropout=0, attention_dropout=0), "eager"
    # smollm2-360m's layer: hidden 960, 15 heads, 5 kv heads, ffn 2560
    return LlamaConfig(num_hidden_layers=layers, hidden_size=960, num_attention_heads=15, num_key_value_heads=5,
                       intermediate_size=2560, vocab_size=1000), "sdpa"


for family in ("gpt2", "bloom", "llama"):
    got, want = {}, {}
    for layers in (2, 4):
        c, attn = config(family, layers)
        model = AutoModelForCausalLM.from_config(c, dtype=torch.float32, attn_implementation=attn).cuda().train()
        got[layers] = saved(model)
        want[layers] = activation_bytes(arch_from_hf_config(c, attn_impl=attn), MICRO, SEQ, "autocast", "cuda").saved_at_forward_end
        del model
    sbh = SEQ * MICRO * c.hidden_size if hasattr(c, "hidden_size") else SEQ * MICRO * c.n_embd
    m, p = (got[4] - got[2]) / 2 / sbh, (want[4] - want[2]) / 2 / sbh
    print(f"{family}: per layer {m:.2f} B/sbh measured, {p:.2f} planned ({p / m - 1:+.1%}); whole 4-layer {got[4]} vs {want[4]:.0f}", flush=True)
