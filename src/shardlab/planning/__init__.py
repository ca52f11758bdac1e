"""Predicting a run before it starts: memory of every strategy, the pipeline split, the micro batch.

    planner.py    `shardlab plan`: per-GPU, CPU and NVMe memory of every strategy (fitted constants documented there)
    pipeline.py   the memory of `--strategy pipeline` per GPU (stage split as strategies/pipeline.py makes it)
    autobatch.py  `--micro-batch auto`: the largest micro batch that runs, from the plan and trial runs
    run_plan.py   the plan of one run: `shardlab train` asks the planner about its own config

Named `planning`, not `plan`: `shardlab.plan` is the library function (shardlab/__init__.py), and a
subpackage of that name would replace it as an attribute of `shardlab` once imported.
The package itself imports nothing.
"""
