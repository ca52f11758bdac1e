"""`python -m shardlab.launch.worker CONFIG.yaml [PLAN.json]`: the body of one spawned worker process."""

from __future__ import annotations

import sys

from ..cli import report_errors
from ..config import load_config
from .distributed import exit_process

# The imports inside main() run inside report_errors, so that an error raised while they import is reported as one
# raised while training is.


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with report_errors() as status:
        from ..planning.run_plan import read_record
        from ..training.trainer import run_worker

        run_worker(load_config(argv[0]), plan=read_record(argv[1]) if len(argv) > 1 else None)
    return status.code


if __name__ == "__main__":
    exit_process(main())
