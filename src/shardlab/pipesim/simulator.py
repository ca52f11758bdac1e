"""Dependency-driven event timing of a pipeline schedule.

Each device walks its schedule's ordered action list (schedules.py). An action starts when
its device is free AND its input has arrived:
  F of stage s   needs F of stage s-1 (same micro-batch) done, plus `comm` if on another device;
  B of stage s   needs B of stage s+1 done (+ comm) and its own F done.
Under a split backward (ZBV) B is two actions: I (the input gradient) needs I of stage s+1 and its
own F, as B does; W (the weight gradient) needs only its own I, and nothing waits for it, which is
how the schedule fills bubbles with W's. A W costs `wgrad` of the stage's backward, its I the rest;
the first stage's I costs nothing (torch runs the first stage's whole backward in its W: its input
is token ids, with no gradient to pass on).
No lock-step clock: idle time (the bubble) falls out of waiting, so unequal stage costs and
communication delays need no special cases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..errors import UserError
from .ascii import ascii_timeline
from .metrics import compute_metrics
from .schedules import FIXED_CHUNKS, SCHEDULES, SPLIT_BACKWARD, SYNCHRONOUS, Action, device_orders, stage_device


@dataclass(frozen=True)
class Event:
    device: int
    kind: str  # "F", "B", or under a split backward "I" (input gradient) and "W" (weight gradient)
    microbatch: int  # 0-based over the whole run (step * M + i); naive: the step's whole batch
    chunk: int  # model chunk on this device (interleaved); 0 otherwise
    start: float
    end: float
    version: int  # weight version used (PipeDream: stashed at F, reused by its B)
    stage: int  # virtual stage index (chunk * P + device, or ZBV's V: schedules.stage_device)
    step: int  # optimizer step (synchronous) / batch of M micro-batches (asynchronous)
    staleness: int  # weight updates this micro-batch misses vs. sequential SGD

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    schedule: str
    stages: int  # P devices
    microbatches: int  # M per step
    chunks: int  # V model chunks per device
    steps: int
    fwd: list[float]  # per-device forward time of one micro-batch (all chunks together)
    bwd: list[float]
    comm: float
    stage_fwd: list[float] = field(default_factory=list)  # per virtual stage (its device's time / V unless given per stage)
    stage_bwd: list[float] = field(default_factory=list)  # the whole backward (I + W under a split backward)
    wgrad: list[float] | None = None  # split backward: W's share of each virtual stage's backward
    events: list[Event] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return self.metrics["makespan"]

    def device_events(self, device: int) -> list[Event]:
        return sorted((e for e in self.events if e.device == device), key=lambda e: e.start)

    def ascii(self, **kwargs) -> str:
        return ascii_timeline(self, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "events"}
        out["events"] = [asdict(e) for e in self.events]
        return out


def _parse(value: float | Sequence[float] | str, name: str) -> float | list[float]:
    if isinstance(value, str):
        try:
            value = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise UserError(f"--{name} {value!r} is not a number or comma-separated list", f"write e.g. --{name} 1,1,2,1") from None
        if len(value) == 1:  # "2" means every stage
            value = value[0]
    if isinstance(value, (int, float)):
        return float(value)
    return [float(v) for v in value]


def _as_list(value: float | Sequence[float] | str, n: int, name: str) -> list[float]:
    values = _parse(value, name)
    values = [values] * n if isinstance(values, float) else values
    if len(values) != n:
        raise UserError(f"--{name} gives {len(values)} stage times but there are {n} stages", f"give one time per stage ({n} comma-separated values) or a single number")
    if any(v <= 0 for v in values):
        raise UserError(f"--{name} times must be positive, got {values}", "use times > 0")
    return values


def _per_stage(value: float | Sequence[float] | str, schedule: str, P: int, V: int, name: str) -> tuple[list[float], list[float]]:
    """(per device, per virtual stage) times from a number, P values (one per device: each of its V stages takes
    1/V of it) or P*V values (one per virtual stage, in stage order: a device's time is the sum of its stages')."""
    values = _parse(value, name)
    if isinstance(values, list) and V > 1 and len(values) == P * V:
        if any(v <= 0 for v in values):
            raise UserError(f"--{name} times must be positive, got {values}", "use times > 0")
        per_device = [sum(values[s] for s in range(P * V) if stage_device(schedule, s, P) == d) for d in range(P)]
        return per_device, values
    if isinstance(values, list) and len(values) != P and V > 1:
        raise UserError(f"--{name} gives {len(values)} stage times but there are {P} stages ({P * V} virtual stages)",
                        f"give one time per stage ({P} comma-separated values), one per virtual stage ({P * V}), or a single number")
    per_device = _as_list(values, P, name)
    return per_device, [per_device[stage_device(schedule, s, P)] / V for s in range(P * V)]


def _wgrad(value: float | Sequence[float] | str | None, schedule: str, P: int, V: int) -> list[float] | None:
    """W's share of each virtual stage's backward under a split backward (None otherwise); the first stage's is 1."""
    if schedule not in SPLIT_BACKWARD:
        if value is not None:
            raise UserError(f"--wgrad applies to schedules that split the backward ({', '.join(SPLIT_BACKWARD)}), not {schedule}",
                            "drop --wgrad or use --schedule zbv")
        return None
    values = _parse(0.5 if value is None else value, "wgrad")
    if isinstance(values, float):
        values = [values] * (P * V)
    elif len(values) == P:
        values = [values[stage_device(schedule, s, P)] for s in range(P * V)]
    elif len(values) != P * V:
        raise UserError(f"--wgrad gives {len(values)} values but there are {P} stages ({P * V} virtual stages)",
                        f"give one share per stage ({P}), one per virtual stage ({P * V}), or a single number")
    if any(not 0 <= v <= 1 for v in values):
        raise UserError(f"--wgrad is the weight gradient's share of a backward, between 0 and 1, got {values}", "use e.g. --wgrad 0.5")
    # torch's first stage runs no input gradient (its input is token ids): its whole backward is the W
    return [1.0] + values[1:]


def _validate(schedule: str, stages: int, microbatches: int, chunks: int, steps: int, comm: float, layers: int | None) -> None:
    if schedule not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {schedule!r}", f"choose one of {', '.join(SCHEDULES)}")
    if stages < 1:
        raise UserError(f"--stages must be at least 1, got {stages}", "use one stage per device, e.g. --stages 4")
    if microbatches < 1:
        raise UserError(f"--microbatches must be at least 1, got {microbatches}", "use e.g. --microbatches 8")
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}", "use e.g. --steps 1")
    if chunks < 1:
        raise UserError(f"--chunks must be at least 1, got {chunks}", "use e.g. --chunks 2 with interleaved-1f1b")
    if schedule in FIXED_CHUNKS and chunks not in (1, FIXED_CHUNKS[schedule]):
        raise UserError(f"{schedule} always places {FIXED_CHUNKS[schedule]} stages on each device, not --chunks {chunks}", "drop --chunks")
    if chunks != 1 and schedule != "interleaved-1f1b" and schedule not in FIXED_CHUNKS:
        raise UserError(f"--chunks {chunks} only applies to interleaved-1f1b, not {schedule}", "drop --chunks or use --schedule interleaved-1f1b")
    if comm < 0:
        raise UserError(f"--comm must be >= 0, got {comm}", "use e.g. --comm 0.1")
    if schedule == "interleaved-1f1b" and microbatches % stages:
        # torch's ScheduleInterleaved1F1B runs micro-batches in rounds of P (Megatron's rule).
        raise UserError(f"interleaved-1f1b needs micro-batches divisible by stages, got M={microbatches}, P={stages}", f"use --microbatches {stages * max(1, round(microbatches / stages))}")
    if schedule == "pipedream-2bw" and microbatches < stages:
        # 2BW keeps two weight versions only if a batch (M micro-batches) covers the pipeline depth.
        raise UserError(f"pipedream-2bw needs micro-batches >= stages, got M={microbatches}, P={stages}", f"use --microbatches {stages} or more")
    if layers is not None:
        if layers < 1:
            raise UserError(f"--layers must be at least 1, got {layers}", "give the model's layer count")
        chunks = FIXED_CHUNKS.get(schedule, chunks)
        if stages * chunks > layers:
            what = f"{stages} stages x {chunks} chunks" if chunks > 1 else f"{stages} stages"
            raise UserError(f"{what} > {layers} layers: some stage would hold no layer", f"use at most {layers // chunks} stages")


def simulate(
    schedule: str,
    stages: int,
    microbatches: int,
    fwd: float | Sequence[float] | str = 1.0,
    bwd: float | Sequence[float] | str = 2.0,
    comm: float = 0.0,
    chunks: int = 1,
    steps: int = 1,
    layers: int | None = None,
    wgrad: float | Sequence[float] | str | None = None,
) -> Timeline:
    """Simulate `steps` optimizer steps of `schedule` on `stages` devices.

    fwd/bwd: time of one micro-batch through one device's whole share of the model (a number
    for equal stages or one value per device); with several chunks per device (interleaved, zbv)
    each of the V chunks takes 1/V of it, unless P*V values give each virtual stage its own time.
    comm: delay for passing activations/gradients between devices. wgrad (zbv only): the weight
    gradient's share of a backward (default 0.5: I and W cost the same, the paper's assumption).
    zbv always runs 2 chunks per device.
    """
    schedule = schedule.lower()
    _validate(schedule, stages, microbatches, chunks, steps, comm, layers)
    chunks = FIXED_CHUNKS.get(schedule, chunks)
    f, sf = _per_stage(fwd, schedule, stages, chunks, "fwd")
    b, sb = _per_stage(bwd, schedule, stages, chunks, "bwd")
    tl = Timeline(schedule, stages, microbatches, chunks, steps, f, b, float(comm), sf, sb, _wgrad(wgrad, schedule, stages, chunks))
    if schedule in SYNCHRONOUS:
        # A flush before every update: steps are identical, each starting when the last ends.
        t0 = 0.0
        for step in range(steps):
            events = _run(tl, device_orders(schedule, stages, microbatches, chunks), t0, step)
            tl.events += events
            t0 = max(e.end for e in events)
    else:
        # No flush: the whole run is one 1F1B stream of steps*M micro-batches.
        tl.events = _run(tl, device_orders(schedule, stages, steps * microbatches), 0.0, 0)
    tl.events.sort(key=lambda e: (e.start, e.device))
    tl.metrics = compute_metrics(tl, simulate)
    return tl


def _run(tl: Timeline, orders: dict[int, list[Action]], t0: float, step: int) -> list[Event]:  # noqa: C901 - one discrete-event loop; its dependency rules are closures over the timeline
    P, V, M = tl.stages, tl.chunks, tl.microbatches
    n_stages = P * V
    # naive: the one action per device carries the whole batch (M micro-batches' worth of work)
    scale = M if tl.schedule == "naive" else 1
    # what stage s's backward waits for from stage s+1: its input gradient
    grad_from_next = "I" if tl.schedule in SPLIT_BACKWARD else "B"

    def device(s: int) -> int:
        return stage_device(tl.schedule, s, P)

    def duration(a: Action) -> float:
        if a.kind == "F":
            return tl.stage_fwd[a.stage] * scale
        if a.kind == "B":
            return tl.stage_bwd[a.stage] * scale
        share = tl.wgrad[a.stage]  # type: ignore[index]  # I and W only under a split backward
        return tl.stage_bwd[a.stage] * (share if a.kind == "W" else 1 - share)

    def hop(s_from: int, s_to: int) -> float:
        return tl.comm if device(s_from) != device(s_to) else 0.0

    def deps(a: Action) -> list[tuple[Action, float]]:
        if a.kind == "F":
            out = [(Action("F", a.microbatch, a.stage - 1), hop(a.stage - 1, a.stage))] if a.stage > 0 else []
            if tl.schedule == "pipedream-2bw" and a.microbatch // M >= 2:
                # batch k runs on W(k-1), which exists once this stage finished batch k-2's backwards
                out.append((Action("B", (a.microbatch // M - 1) * M - 1, a.stage), 0.0))
            return out
        if a.kind == "W":  # the weight gradient needs only its own stage's input gradient (the saved grads)
            return [(Action("I", a.microbatch, a.stage), 0.0)]
        out = [(Action("F", a.microbatch, a.stage), 0.0)]
        if a.stage < n_stages - 1:
            out.append((Action(grad_from_next, a.microbatch, a.stage + 1), hop(a.stage + 1, a.stage)))
        return out

    end: dict[Action, float] = {}
    placed: list[tuple[Action, float, float, int]] = []
    free = [t0] * P
    ptr = [0] * P
    backwards_done = [0] * P  # PipeDream: one weight update per backward
    stash: dict[Action, int] = {}  # F's version, reused by its B (weight stashing)
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for d in range(P):
            while ptr[d] < len(orders[d]):
                a = orders[d][ptr[d]]
                ds = deps(a)
                if any(dep not in end for dep, _ in ds):
                    break  # input not computed yet: another device must run first
                start = max([free[d]] + [end[dep] + delay for dep, delay in ds])
                stop = start + duration(a)
                end[a] = free[d] = stop
                version = _version(tl, a, step, backwards_done[d], stash)
                if a.kind == "B":
                    backwards_done[d] += 1
                placed.append((a, start, stop, version))
                ptr[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # an order that waits on its own future: a bug in schedules.py
            stuck = {d: orders[d][ptr[d]] for d in range(P) if ptr[d] < len(orders[d])}
            raise RuntimeError(f"pipeline schedule {tl.schedule} deadlocks at {stuck}")
    offset = step * M if tl.schedule in SYNCHRONOUS and tl.schedule != "naive" else 0
    events = []
    for a, start, stop, version in placed:
        mb = a.microbatch + offset if tl.schedule != "naive" else step
        events.append(
            Event(
                device=device(a.stage),
                kind=a.kind,
                microbatch=mb,
                chunk=a.stage // P,
                start=start,
                end=stop,
                version=version,
                stage=a.stage,
                step=step if tl.schedule in SYNCHRONOUS else a.microbatch // M,
                staleness=_staleness(tl, a, version),
            )
        )
    return events


def _version(tl: Timeline, a: Action, step: int, backwards_done: int, stash: dict[Action, int]) -> int:
    """Weight version a micro-batch uses on this stage."""
    if tl.schedule == "pipedream":
        if a.kind == "F":  # latest weights: one update per backward finished on this device
            stash[a] = backwards_done
            return backwards_done
        return stash.pop(Action("F", a.microbatch, a.stage))  # stashed: same weights as its forward
    if tl.schedule == "pipedream-2bw":
        # W(t+1) = W(t) - lr * grad(W(t-1)): batch k (all its micro-batches, on every stage) uses W(k-1)
        return max(0, a.microbatch // tl.microbatches - 1)
    return step  # synchronous: every micro-batch of step k sees the weights after k updates


def _staleness(tl: Timeline, a: Action, version: int) -> int:
    """Updates missed vs. sequential SGD with the same update granularity."""
    if tl.schedule == "pipedream":  # one update per micro-batch: sequential would use version m
        return a.microbatch - version
    if tl.schedule == "pipedream-2bw":  # one update per batch: sequential would use version k
        return a.microbatch // tl.microbatches - version
    return 0
