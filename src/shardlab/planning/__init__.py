"""Predicting a run before it starts: memory of every strategy, the pipeline split, the micro batch.

    planner.py       `shardlab plan`: every strategy's row, whether it fits, the recommendation (what is counted, and
                     the sources of its constants, are in its docstring)
    arch.py          the model's architecture as the planner sees it: read from the HF config and the meta-device model
    strategy_plan.py one strategy's prediction: its engine's memory model composed with the activations (GPU or CPU)
    budget.py        what a plan must fit (GPU memory given or detected, host RAM, NVMe) and the verdict against it
    micro_search.py  the plan's micro-batch searches: each strategy's largest that fits, auto's start, beyond exact AdamW
    step.py          one rank's step, moment by moment: the activations composed with what the engine holds
    host.py          host memory: the engine's host buffers and build, the processes (strategy_plan adds them up)
    render.py        `shardlab plan`'s tables (rich), apart so that the planner loads without it
    cpu_plan.py      `shardlab plan --device cpu`: the whole CPU run's host memory under every strategy
    memory.py        the memory model's shared parts: allowances, Arch, activations, StrategyPlan
    adapters.py      what --peft lora/qlora hold: a frozen base and the adapters (strategy_plan asks it)
    microbatch.py    the micro batches `auto` may choose and the one largest-that-fits search (plan, run_plan, autobatch)
    autobatch.py     `--micro-batch auto`: the largest micro batch that runs, from the plan and trial runs
    run_plan.py      the plan of one run: `shardlab train` asks the planner about its own config

What each engine holds (on the GPU, the host, NVMe; a pipeline's GPUs each) is not here: it is the engine's memory model,
beside its implementation (strategies/memory/), which the planner asks through the strategy's spec.

Imports go one way: cpu_plan -> run_plan -> planner -> micro_search -> strategy_plan -> step, host, adapters -> memory,
with arch and budget under micro_search (strategy_plan reads arch too); render -> planner, budget; autobatch ->
micro_search; and each of run_plan, autobatch and micro_search -> microbatch (the launcher calls run_plan and autobatch;
nothing here imports the launcher).

Named `planning`, not `plan`: `shardlab.plan` is the library function (shardlab/__init__.py), and a
subpackage of that name would replace it as an attribute of `shardlab` once imported.
The package itself imports nothing.
"""
