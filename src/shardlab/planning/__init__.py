"""Predicting a run before it starts: memory of every strategy, the pipeline split, the micro batch.

    planner.py    `shardlab plan`: per-GPU, CPU and NVMe memory of every strategy (fitted constants documented there)
    step.py       one rank's step, moment by moment: the activations composed with what the engine holds
    host.py       host memory: the engine's host buffers and build, the processes (planner adds them up)
    render.py     `shardlab plan`'s tables (rich), apart so that the planner loads without it
    cpu_plan.py   `shardlab plan --device cpu`: the whole CPU run's host memory under every strategy
    memory.py     the memory model's shared parts: allowances, Arch, activations, StrategyPlan
    microbatch.py the micro batches `auto` may choose and the one largest-that-fits search (plan, run_plan, autobatch)
    autobatch.py  `--micro-batch auto`: the largest micro batch that runs, from the plan and trial runs
    run_plan.py   the plan of one run: `shardlab train` asks the planner about its own config

What each engine holds (on the GPU, the host, NVMe; a pipeline's GPUs each) is not here: it is the engine's memory model,
beside its implementation (strategies/memory/), which the planner asks through the strategy's spec.

Imports go one way: cpu_plan -> run_plan, render -> planner, and run_plan and autobatch -> planner -> step, host ->
memory, and each of run_plan, autobatch and planner -> microbatch (the launcher calls run_plan and autobatch; nothing here
imports the launcher).

Named `planning`, not `plan`: `shardlab.plan` is the library function (shardlab/__init__.py), and a
subpackage of that name would replace it as an attribute of `shardlab` once imported.
The package itself imports nothing.
"""
