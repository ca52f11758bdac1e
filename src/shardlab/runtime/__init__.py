"""What a running process needs about itself, below the engines and the loop that call it and the launcher above them.

    distributed.py   rank, world size, device; process-group setup and teardown; the CPU heap kept for reuse
    resolved.py      the run this process runs: the config and what this machine makes of it, decided once
    process.py       torch-free facts: whether a launcher made this process a rank, the heap threshold
    preemption.py    SIGTERM/SIGUSR1: graceful end and on-demand checkpoints
    guards.py        a dead or hung peer rank: fail fast, in one line
    faults.py        deliberate failures for the crash-safety tests (SHARDLAB_FAULTS)
    pin.py           pin a rank's training thread to one of its CPUs
    procgroup.py     a command in its own process group, ended whole on a timeout or an interrupt

It sits low in the layers (above compat, specs and errors, which it imports): the training pieces, the strategies,
checkpoint store, planning's --micro-batch auto and the loop all use it, and none of them may pull in the launcher
(and torch elastic) from launch/. The package itself imports nothing.
"""
