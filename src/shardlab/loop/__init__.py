"""One worker's training loop, above the engines, checkpoints and plans it drives, and below the launcher that runs it.

    trainer.py         the training loop, strategy-agnostic; writes the run directory
    evaluation.py      the eval split's loss, token-weighted over all ranks
    reporting.py       what a run tells the user: rank 0's messages, progress, env.json, the summary table
    generate.py        `shardlab generate` and a run's samples.md
    warm_8bit.py       torchao's 8-bit step compiled and autotuned before training (sized by the planner)

The package itself imports nothing (torch loads only when a module here is imported).
"""
