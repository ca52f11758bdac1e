"""What one worker trains with: the pieces the engines (strategies/) and the loop (loop/) build on, below both.

    models.py          what --model builds: presets, hub ids, local directories, GGUF files; configs, attention
    hub.py             what a model or tokenizer name is; the hub cache first, online only where reachable
    gguf_files.py      GGUF files: packaged ones, each part parsed once and kept
    tokenizing.py      tokenizers (GPT-2's BPE from a package, a model's own), and runs that need none
    optim.py           precision, AdamW parameter groups, learning-rate schedules (shared by every strategy)
    loss.py            the causal-LM loss outside the model (chunked, compile-friendly)
    compiling.py       --compile: the whole model or each block
    adapters.py        --peft lora/qlora: low-rank adapters (peft) on a frozen base model
    early_stopping.py  eval-loss bookkeeping and early stopping
    sampling.py        a seekable DistributedSampler for resumes

Named `training`, not `train`: `shardlab.train` is the library function (shardlab/__init__.py), and a
subpackage of that name would replace it as an attribute of `shardlab` once imported.
The package itself imports nothing (torch loads only when a module here is imported).
"""
