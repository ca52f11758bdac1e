"""One worker's training: the loop and what it trains with.

    trainer.py         the training loop, strategy-agnostic; writes the run directory
    models.py          presets, hub ids, local directories, GGUF; tokenizers
    optim.py           precision, AdamW parameter groups, learning-rate schedules (shared by every strategy)
    loss.py            the causal-LM loss outside the model (chunked, compile-friendly)
    early_stopping.py  eval-loss bookkeeping and early stopping
    sampling.py        a seekable DistributedSampler for resumes
    generate.py        `shardlab generate` and a run's samples.md

Named `training`, not `train`: `shardlab.train` is the library function (shardlab/__init__.py), and a
subpackage of that name would replace it as an attribute of `shardlab` once imported.
The package itself imports nothing (torch loads only when a module here is imported).
"""
