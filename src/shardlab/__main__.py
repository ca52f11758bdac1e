import sys

from .cli import main

code = main()
# A command that trained in this process (joined torchrun/srun ranks) may hold a process group broken by a dead
# peer, which must not be torn down (distributed.exit_process); a command that never imported it exits plainly.
distributed = sys.modules.get("shardlab.runtime.distributed")
if distributed is not None:
    distributed.exit_process(code)
sys.exit(code)
