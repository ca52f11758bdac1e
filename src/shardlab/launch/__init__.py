"""Getting processes to run: spawning or joining workers, and everything about the processes themselves.

    launcher.py      `shardlab train`'s front half: preflight, plan record, spawn workers (torch elastic) or join torchrun/srun
    worker.py        `python -m shardlab.launch.worker CONFIG [PLAN]`: the body of one spawned worker process
    supervise.py     the small parent that outlives the training process (OOM-killer, signals)
    failures.py      how a worker failed, in one line (torch-free: the supervisor catches it too)
    nodes.py         --nodes/--node-rank, hostfiles, SLURM's variables
    slurm.py         `shardlab slurm`: sbatch scripts with a code/config snapshot
    run_lock.py      one run per output directory
    bytecode.py      bytecode for the training processes' imports, where Python would not keep it
    buildlocks.py    stale DeepSpeed JIT-build locks (a preflight check)

It sits high in the layers, under the command line: what a running process needs about itself (rank and device,
signals, peer guards, faults, the thread pin, process groups) is in runtime/, far below, so that the training loop
and the strategies use it without pulling in the launcher (and torch elastic). The package itself imports nothing.
"""
