"""Getting processes to run: spawning or joining workers, and everything about the processes themselves.

    launcher.py      `shardlab train`'s front half: preflight, plan record, spawn workers (torch elastic) or join torchrun/srun
    worker.py        `python -m shardlab.launch.worker CONFIG [PLAN]`: the body of one spawned worker process
    supervise.py     the small parent that outlives the training process (OOM-killer, signals)
    distributed.py   rank, world size, device; process-group setup and teardown
    nodes.py         --nodes/--node-rank, hostfiles, SLURM's variables
    slurm.py         `shardlab slurm`: sbatch scripts with a code/config snapshot
    preemption.py    SIGTERM/SIGUSR1: graceful end and on-demand checkpoints
    guards.py        a dead or hung peer rank: fail fast, in one line
    faults.py        deliberate failures for the crash-safety tests (SHARDLAB_FAULTS)
    buildlocks.py    stale DeepSpeed JIT-build locks (a preflight check)

The package itself imports nothing: `distributed`, `preemption`, `guards` and `faults` are also used by the
training loop and the strategies, which must not pull in the launcher (and torch elastic) with them.
"""
