"""See what a model writes: `shardlab generate RUN_DIR_OR_MODEL --prompt ...` and a run's samples.md.

    shardlab generate runs/demo --prompt "The with statement"           greedy, from runs/demo/model
    shardlab generate runs/demo --prompt "..." --sample --top-p 0.9 --seed 1

A run directory stands for its exported model (RUN_DIR/model, weights and tokenizer); a
save_pretrained directory, a preset or a hub id in the local cache are loaded as `--model` is.
Completions come from transformers' `generate` (greedy unless --sample).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..config import RunConfig

# Lazy imports below: the CLI imports this module for its `generate` parser; torch, transformers and the models load
# only when generating.

# torch, transformers and shardlab's engine modules are imported in the functions: the CLI builds this
# command's parser on every start, and `shardlab --help` imports no torch.

# samples.md's prompts: two on the offline corpus's subject (CPython's documentation), one that a
# pretrained model knows, so that a fine-tune that breaks general knowledge shows.
SAMPLE_PROMPTS = ("The with statement in Python", "A generator function is", "The capital of France is")
SAMPLE_MAX_NEW_TOKENS = 24
SAMPLES_FILE = "samples.md"


def complete(model, tokenizer, prompt: str, *, max_new_tokens: int = SAMPLE_MAX_NEW_TOKENS, sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0) -> str:
    """The text `model` appends to `prompt`: greedy, or sampled with temperature and nucleus (top-p) only."""
    import torch
    from transformers import GenerationConfig

    # A config of our own: the model's generation_config may ask for sampling, top-k or a length limit.
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
                           top_p=top_p if sample else None, top_k=0 if sample else None,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id)  # fmt: skip
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    was_training = model.training
    model.eval()  # no dropout
    try:
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=gen)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def complete_all(model, tokenizer, prompts: list[str] | tuple[str, ...]) -> list[str]:
    """Greedy completions for samples.md, leaving the caller's random state as it was (training resumes
    exactly as without samples)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return [complete(model, tokenizer, p) for p in prompts]


def model_dir(name: str) -> str:
    """What `name` loads: a run directory's exported model, a model directory, else `name` itself
    (a preset or hub id, resolved by shardlab.training.models)."""
    from ..checkpoint.store import EXPORT_DIR, find_resume_dir

    path = Path(name).expanduser()
    if not path.exists():
        return name
    if not path.is_dir():
        return name  # a file: shardlab.training.models says whether it can load it
    for candidate in (path / EXPORT_DIR, path):  # a model (config.json) or a --peft run's adapter (adapter_config.json)
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return str(candidate)
    if (path / "summary.json").is_file() or (path / "config.yaml").is_file():
        if find_resume_dir("auto", path) is None:  # nothing `shardlab export` could read either
            raise UserError(f"run directory {name!r} has no exported model ({EXPORT_DIR}/) and no checkpoint: it ran with "
                            "--no-export and saved no checkpoint, so its trained weights were not kept",
                            "train it again without --no-export (or with --save-every N)")
        raise UserError(f"run directory {name!r} has no exported model ({EXPORT_DIR}/)",
                        f"it ran with --no-export: `shardlab export {name} {path / EXPORT_DIR}` writes one from its newest checkpoint")
    raise UserError(f"{name!r} holds neither a model (config.json) nor a run's exported {EXPORT_DIR}/",
                    "pass a run directory (shardlab train --output-dir) or a save_pretrained directory")


def load(name: str, tokenizer: str | None = None, device: str = "cpu"):
    """(model in fp32 on `device`, tokenizer, what was loaded) for a run directory, model directory, adapter directory
    (its base model rebuilt, the adapter loaded by peft), preset or hub id."""
    from ..training import adapters
    from ..training.tokenizing import TOKENIZER_FILES, load_tokenizer
    from ..training.models import build_model

    source = model_dir(name)
    if adapters.is_adapter_dir(Path(source)):
        base = adapters.base_config(Path(source), device)
        own = any((Path(source) / f).is_file() for f in TOKENIZER_FILES)  # the run saved its tokenizer beside the adapter
        tok = load_tokenizer(base.model_copy(update={"tokenizer": tokenizer or (source if own else base.tokenizer)}))
        return adapters.load_adapted(Path(source), device), tok, source
    # seq_len 1: the only length to check is the prompt's plus the new tokens, which `main` checks
    cfg = RunConfig(model=source, tokenizer=tokenizer, seq_len=1, device=device)
    try:
        tok = load_tokenizer(cfg)
        model = build_model(cfg, device_type=device)
    except UserError as err:
        if source == name and not Path(name).expanduser().exists():  # what the user most likely meant: a path
            raise UserError(f"{name!r} is neither a directory nor a model available offline ({err.message})",
                            "pass a run directory (shardlab train --output-dir), a save_pretrained directory, a preset, "
                            "or a hub id in the local Hugging Face cache") from None
        raise
    return model.to(device), tok, source


def _fence(text: str) -> str:
    """A Markdown code fence longer than any run of backticks in `text`."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def samples_markdown(model_name: str, prompts: list[str] | tuple[str, ...], before: list[str] | str, after: list[str] | None,
                     after_label: str) -> str:
    """samples.md: each prompt with its completion before and after training (`after` None: `after_label` says why;
    `before` a string: why there are no completions before training)."""
    out = [f"# Samples: {model_name}", "",
           f"Greedy completions (at most {SAMPLE_MAX_NEW_TOKENS} new tokens) of fixed prompts, before training (the model "
           f"as loaded) and after ({after_label}). Try others with `shardlab generate RUN_DIR --prompt \"...\"`.", ""]
    for i, prompt in enumerate(prompts):
        out += [f"## Prompt {i + 1}", ""]
        for label, texts, why in (("Before fine-tuning", before, before), ("After fine-tuning", after, after_label)):
            if texts is None or isinstance(texts, str):
                out += [f"{label}: none ({why}).", ""]
                continue
            text = prompt + texts[i]
            fence = _fence(text)
            out += [f"{label}:", "", f"{fence}text", text, fence, ""]
    return "\n".join(out)


# ---- the command --------------------------------------------------------------------------------


def add_generate_parser(sub) -> None:
    ge = sub.add_parser("generate", help="complete prompts with a trained model (a run directory's export) or any model directory")
    ge.add_argument("model", metavar="RUN_DIR_OR_MODEL", help="run directory (its model/), save_pretrained directory, preset or cached hub id")
    ge.add_argument("--prompt", "-p", action="append", required=True, help="text to complete (repeatable)")
    ge.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    ge.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    ge.add_argument("--temperature", type=float, default=None, help="--sample: softmax temperature (default 1.0)")
    ge.add_argument("--top-p", type=float, default=None, help="--sample: nucleus sampling mass (default 1.0: all tokens)")
    ge.add_argument("--seed", type=int, default=None, help="--sample: random seed, for the same text again")
    ge.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's own)")
    ge.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run (default: a GPU if visible)")


def _check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}", "pass e.g. --max-new-tokens 64")
    for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p), ("--seed", args.seed)):
        if value is not None and not args.sample:
            raise UserError(f"{flag} applies to sampling, and decoding is greedy", f"add --sample, or drop {flag}")
    if args.temperature is not None and args.temperature <= 0:
        raise UserError(f"--temperature must be positive, got {args.temperature}", "pass e.g. --temperature 0.7 (greedy: drop --sample)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}", "pass e.g. --top-p 0.9")


def cmd_generate(args: argparse.Namespace) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from ..runtime.distributed import pick_device_type
    from ..training.models import max_positions

    _check_args(args)
    device = pick_device_type(args.device)
    hf_logging.disable_progress_bar()  # stderr keeps to our lines; stdout holds only the texts
    model, tok, source = load(args.model, args.tokenizer, device)
    limit = max_positions(model.config)
    for prompt in args.prompt:
        n_prompt = len(tok(prompt)["input_ids"])
        if limit is not None and n_prompt + args.max_new_tokens > limit:
            raise UserError(f"the prompt's {n_prompt} tokens + --max-new-tokens {args.max_new_tokens} exceed the model's {limit} positions",
                            f"use --max-new-tokens {max(1, limit - n_prompt)} or a shorter prompt")
    print(f"[shardlab] {source}: {'sampling' if args.sample else 'greedy'}, at most {args.max_new_tokens} new tokens", file=sys.stderr)
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "sample": args.sample}
    if args.sample:
        options.update(temperature=args.temperature or 1.0, top_p=args.top_p or 1.0)
    for prompt in args.prompt:
        if args.seed is not None:
            torch.manual_seed(args.seed)  # per prompt: each prompt's text does not depend on the ones before
        print(prompt + complete(model, tok, prompt, **options), flush=True)
