"""`python -m shardlab.worker CONFIG.yaml`: the body of one spawned worker process."""

from __future__ import annotations

import sys

from .cli import report_errors
from .config import load_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with report_errors() as status:
        from .trainer import run_worker

        run_worker(load_config(argv[0]))
    return status.code


if __name__ == "__main__":
    sys.exit(main())
