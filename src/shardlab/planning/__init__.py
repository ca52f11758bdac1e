"""Predicting a run before it starts: memory of every strategy, the pipeline split, the micro batch.

    planner.py    `shardlab plan`: per-GPU, CPU and NVMe memory of every strategy (fitted constants documented there)
    memory.py     the memory model's shared parts: allowances, Arch, activations, StrategyPlan (planner and pipeline read them)
    pipeline.py   the memory of `--strategy pipeline` per GPU (stage split as strategies/pipeline.py makes it)
    microbatch.py the micro batches `auto` may choose and the one largest-that-fits search (plan, run_plan, autobatch)
    autobatch.py  `--micro-batch auto`: the largest micro batch that runs, from the plan and trial runs
    run_plan.py   the plan of one run: `shardlab train` asks the planner about its own config

Imports go one way: run_plan and autobatch -> planner -> pipeline -> memory, and each of the first three ->
microbatch (the launcher calls run_plan and autobatch; nothing here imports the launcher).

Named `planning`, not `plan`: `shardlab.plan` is the library function (shardlab/__init__.py), and a
subpackage of that name would replace it as an attribute of `shardlab` once imported.
The package itself imports nothing.
"""
