"""torch's ScheduleZBVZeroBubble on this machine's torch against pipesim's zbv: per-rank F/I/W order (as built and as
lowered for the runtime) and the V placement, P = 1..8 ranks, M = 1..32 micro-batches. tests/test_pipesim.py checks the
same against the local torch; this runs where pytest is not installed (the GPU machine, torch 2.11).

    PYTHONPATH=src python3 benchmarks/diag/zbv_torch_orders.py      # exit status 1 on a mismatch or no ZBV
"""
import inspect
import sys
from types import SimpleNamespace

import torch
import torch.distributed.pipelining.schedules as S
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from shardlab.pipesim.schedules import device_orders, stage_device

COMPUTE = ("F", "I", "W", "B")


def compute(actions):
    out = []
    for a in actions:
        if a is None:
            continue
        kind = getattr(a.computation_type, "value", a.computation_type)
        kind = kind if isinstance(kind, str) else str(a.computation_type)
        if kind in COMPUTE:
            out.append((kind, a.microbatch_index, a.stage_index))
    return out


def main() -> int:
    zbv = getattr(S, "ScheduleZBVZeroBubble", None)
    print("torch", torch.__version__, "ScheduleZBVZeroBubble:", zbv is not None)
    if zbv is None:
        return 1
    print("signature:", inspect.signature(zbv.__init__))
    bad = 0
    for P in range(1, 9):
        if generate_stage_to_rank_mapping(P, 2 * P, style="v") != {s: stage_device("zbv", s, P) for s in range(2 * P)}:
            bad += 1
            print("placement differs for", P, "ranks")
        for M in range(1, 33):
            # submod=None: torch's check that no stage module is compiled skips a stage without one
            stages = [SimpleNamespace(num_stages=2 * P, group_size=P, group_rank=0, stage_index=s, submod=None) for s in (0, 2 * P - 1)]
            sched = zbv(stages, M)
            ours = {d: [tuple(a) for a in acts] for d, acts in device_orders("zbv", P, M).items()}
            built = {r: compute(a) for r, a in sched.pipeline_order.items()}
            lowered = {r: compute(a) for r, a in sched.pipeline_order_with_comms.items()}
            if built != ours or lowered != ours:
                bad += 1
                print("order differs: P", P, "M", M)
    print(f"zbv: {bad} differences in 8 placements and {8 * 32} orders")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
