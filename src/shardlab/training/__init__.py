"""What one worker trains with: the pieces the engines (strategies/) and the loop (loop/) build on, below both.

    models.py          presets, hub ids, local directories, GGUF; tokenizers
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
