"""What this process is, for readers that must not load torch: a rank of a launched job or not, and the heap threshold
a CPU run gives glibc.

torch-free on purpose: the supervising parent (launch/supervise.py) and the planner's host model (planning/host.py)
read these without the seconds torch costs; distributed.py, which loads torch, uses them and re-exports them.
"""

from __future__ import annotations

import os

# Set by the script `shardlab slurm` writes: this srun task is one node's launcher, not a rank.
NODE_AGENT_ENV = "SHARDLAB_NODE_AGENT"
# The M_TRIM_THRESHOLD runtime.distributed.reuse_freed_heap gives glibc on CPU runs: free memory at the top of the heap
# goes back to the system only above it (so planning.host.heap_kept_bytes can bound what the heap keeps)
HEAP_TRIM_BYTES = 2**31 - 1


def in_launched_job() -> bool:
    """True when some launcher (ours, torchrun, deepspeed, srun with >1 task) already made us a rank."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    if os.environ.get(NODE_AGENT_ENV):
        return False
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ
