"""Pipeline schedule simulator against closed forms and against torch.distributed.pipelining's own orders.

Fast and in-process: no distributed job. Torch's orders come from (a) ScheduleGPipe/Schedule1F1B's
real `_step_microbatches` loop driven with a recording fake stage, (b) the `pipeline_order` IR
that ScheduleGPipe/Schedule1F1B/ScheduleInterleaved1F1B/ScheduleZBVZeroBubble build in their
constructors, and (c) the lowered `pipeline_order_with_comms` that _PipelineScheduleRuntime actually
executes (interleaved, zbv).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from shardlab.errors import UserError
from shardlab.pipesim import SCHEDULES, device_orders, render_timeline, simulate, tutorial_diagrams
from shardlab.pipesim.schedules import stage_device

PS = [2, 3, 4, 8]
MS = [1, 2, 4, 8, 16]


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
def test_bubble_gpipe_1f1b(schedule, P, M):
    """bubble = idle / (P * makespan) = (P-1)/(M+P-1), equal stages, fwd 1 : bwd 2, no comm."""
    tl = simulate(schedule, P, M, fwd=1, bwd=2)
    assert tl.metrics["makespan"] == pytest.approx(3 * (M + P - 1))
    assert tl.metrics["bubble_fraction"] == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)
    assert tl.metrics["throughput_vs_naive"] == pytest.approx(P * M / (M + P - 1))


@pytest.mark.parametrize("fwd,bwd", [(1, 1), (1, 3), (2, 3)])
def test_bubble_formula_any_fwd_bwd_ratio(fwd, bwd):
    for P in PS:
        for M in MS:
            for s in ("gpipe", "1f1b"):
                assert simulate(s, P, M, fwd=fwd, bwd=bwd).metrics["bubble_fraction"] == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)


@pytest.mark.parametrize("P", PS)
def test_naive_is_one_device_at_a_time(P):
    tl = simulate("naive", P, 4)
    assert tl.metrics["bubble_fraction"] == pytest.approx((P - 1) / P)
    assert tl.metrics["throughput_vs_naive"] == 1
    assert simulate("naive", 4, 1).metrics["mean_utilisation"] == pytest.approx(0.25)


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("V", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_bubble_interleaved(P, V, k):
    """M divisible by P: bubble = (P-1)/(V*M+P-1) exactly; makespan = (f+b)*(M + (P-1)/V).

    Each chunk costs 1/V of the device's per-micro-batch time, so the fill/drain shrinks V-fold.
    """
    M = k * P
    for fwd, bwd in [(1, 2), (1, 1)]:
        tl = simulate("interleaved-1f1b", P, M, fwd=fwd, bwd=bwd, chunks=V)
        assert tl.metrics["bubble_fraction"] == pytest.approx((P - 1) / (V * M + P - 1), abs=1e-12)
        assert tl.metrics["makespan"] == pytest.approx((fwd + bwd) * (M + (P - 1) / V))
        if V > 1:
            assert tl.metrics["bubble_fraction"] < simulate("1f1b", P, M, fwd=fwd, bwd=bwd).metrics["bubble_fraction"]


@pytest.mark.parametrize("P", [1, *PS])
def test_bubble_zbv(P):
    """ZBV with F = I = W = t on every chunk (fwd 1 : bwd 2 per device, wgrad 0.5) and M >= 2P-1: makespan
    6Mt + (P-1)t, bubble (P-1)/(6M+P-1) -- the fill of the first forwards is all that is left: far below
    1F1B's (P-1)/(M+P-1) and interleaved 1F1B's (P-1)/(2M+P-1) with the same two chunks per device."""
    for M in sorted({2 * P - 1, 2 * P, 3 * P, 16}):
        tl = simulate("zbv", P, M)
        assert tl.chunks == 2
        assert tl.metrics["makespan"] == pytest.approx(3 * M + (P - 1) / 2)
        assert tl.metrics["bubble_fraction"] == pytest.approx((P - 1) / (6 * M + P - 1), abs=1e-12)
        assert tl.metrics["bubble_theory"] == pytest.approx(tl.metrics["bubble_fraction"], abs=1e-12)
        if P > 1:
            assert tl.metrics["bubble_fraction"] < simulate("1f1b", P, M).metrics["bubble_fraction"]
            if M % P == 0:
                assert tl.metrics["bubble_fraction"] < simulate("interleaved-1f1b", P, M, chunks=2).metrics["bubble_fraction"]
    # fewer micro-batches than 2P-1: torch drops the planned ones >= M, the bubble grows; no closed form claimed
    if P > 2:
        assert simulate("zbv", P, 2).metrics["bubble_theory"] is None
    # I and W of unequal cost: no closed form, still far below 1F1B
    tl = simulate("zbv", 4, 8, fwd=1, bwd=2, wgrad=0.25)
    assert tl.metrics["bubble_theory"] is None and tl.metrics["bubble_fraction"] < simulate("1f1b", 4, 8).metrics["bubble_fraction"] / 2


def test_zbv_splits_the_backward_and_defers_w():
    """I costs (1 - wgrad) of the stage's backward and W the rest (the first stage's I nothing: torch runs its whole
    backward in the W); each W comes after its own I; W's are what fills the would-be bubble, so with W's made
    free (wgrad 0 everywhere but the first stage) the schedule loses its filler and idles more."""
    P, M = 4, 8
    tl = simulate("zbv", P, M, fwd=1, bwd=2, wgrad=0.25)
    by = {(e.kind, e.microbatch, e.stage): e for e in tl.events}
    for e in tl.events:
        if e.kind == "I":
            assert e.duration == pytest.approx(0.0 if e.stage == 0 else 0.75 * 2 / 2)
        if e.kind == "W":
            assert e.duration == pytest.approx(1.0 if e.stage == 0 else 0.25 * 2 / 2)
            assert e.start >= by[("I", e.microbatch, e.stage)].end - 1e-12
    assert {e.kind for e in tl.events} == {"F", "I", "W"}
    assert sum(e.duration for e in tl.events) == pytest.approx(P * M * 3)  # every device: M x (fwd + bwd)
    # W's pending (I done, W not): the first device defers fewest, the last most
    pending = tl.metrics["peak_w_pending"]
    assert pending == sorted(pending) and pending[-1] > pending[0] >= 1
    assert simulate("1f1b", P, M).metrics["peak_w_pending"] == [0] * P


@pytest.mark.parametrize("P", PS)
def test_zbv_holds_what_1f1b_holds(P):
    """The paper's claim for ZB-V: the peak activation memory of 1F1B's first stage (P micro-batches through a device's
    share), on every device -- counted until each W, not each I, since torch keeps the graph for the W."""
    for M in (2 * P, 4 * P):
        tl = simulate("zbv", P, M)
        assert tl.metrics["peak_inflight"] == [2 * P] * P  # (micro-batch, chunk) pairs, each 1/2 of a device's share
        assert tl.metrics["peak_activations"] == [P] * P
        assert max(simulate("1f1b", P, M).metrics["peak_activations"]) == P


def test_per_virtual_stage_times():
    """P*V values give each virtual stage its own time (a device's time is the sum of its stages'); P values split
    evenly over a device's chunks, as before. ZBV's V: device 0 holds the first and the last stage."""
    tl = simulate("zbv", 2, 4, fwd=[1, 2, 3, 4], bwd=[2, 4, 6, 8])
    assert tl.fwd == [5, 5] and tl.bwd == [10, 10] and tl.stage_fwd == [1, 2, 3, 4]
    assert {e.stage: e.device for e in tl.events} == {0: 0, 1: 1, 2: 1, 3: 0}
    assert {e.duration for e in tl.events if e.kind == "F" and e.stage == 3} == {4}
    even = simulate("interleaved-1f1b", 2, 4, chunks=2, fwd=[1, 2], bwd=[2, 4])
    assert even.stage_fwd == [0.5, 1, 0.5, 1] and even.makespan == simulate("interleaved-1f1b", 2, 4, chunks=2, fwd=[0.5, 1, 0.5, 1],
                                                                          bwd=[1, 2, 1, 2]).makespan


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
def test_activations_in_flight(P, M):
    assert simulate("gpipe", P, M).metrics["peak_inflight"] == [M] * P
    one = simulate("1f1b", P, M).metrics["peak_inflight"]
    assert one[0] == min(M, P)
    assert one == [min(M, P - i) for i in range(P)]


@pytest.mark.parametrize("P", PS)
def test_pipedream_weight_stashing(P):
    M, steps = 4, 2 * P  # 8P micro-batches: long enough to reach steady state
    tl = simulate("pipedream", P, M, steps=steps)
    assert tl.metrics["weight_versions"] == [P - i for i in range(P)]
    assert tl.metrics["max_staleness"] == [P - 1 - i for i in range(P)]
    fwd = {(e.microbatch, e.stage): e.version for e in tl.events if e.kind == "F"}
    for e in tl.events:
        if e.kind == "B":  # weight stashing: backward uses exactly its forward's weights
            assert e.version == fwd[(e.microbatch, e.stage)]
    steady = range(2 * P, steps * M - 2 * P)
    for m in steady:  # micro-batch m on stage i misses the updates of the P-1-i micro-batches before it
        assert tl.metrics["staleness"][m] == [P - 1 - i for i in range(P)]
    # no flush: better than synchronous 1F1B over the same steps
    assert tl.metrics["bubble_fraction"] < simulate("1f1b", P, M, steps=steps).metrics["bubble_fraction"]


@pytest.mark.parametrize("P", PS)
def test_pipedream_2bw_two_versions(P):
    M, steps = P, 6
    tl = simulate("pipedream-2bw", P, M, steps=steps)
    assert tl.metrics["weight_versions"] == [2] * P
    for e in tl.events:  # batch k uses W(k-1) on every stage: 1-stale, consistent across stages
        assert e.version == max(0, e.microbatch // M - 1)
    assert max(tl.metrics["max_staleness"]) == 1


def test_synchronous_schedules_hold_one_version():
    for s in ("naive", "gpipe", "1f1b"):
        tl = simulate(s, 4, 8, steps=3)
        assert tl.metrics["weight_versions"] == [1] * 4
        assert tl.metrics["max_staleness"] == [0] * 4
        assert tl.metrics["makespan"] == pytest.approx(3 * simulate(s, 4, 8).metrics["makespan"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dependencies_respected(schedule):
    """Unequal stages + comm: every action waits for its input; a device runs one action at a time."""
    P, comm = 4, 0.3
    tl = simulate(schedule, P, 8, fwd="1,1.5,0.5,1", bwd="2,3,1,2", comm=comm, chunks=2 if schedule == "interleaved-1f1b" else 1, steps=2)
    by = {(e.kind, e.microbatch, e.stage): e for e in tl.events}
    last = P * tl.chunks - 1
    grad = "I" if schedule == "zbv" else "B"

    def hop(a, b):  # zbv's V keeps stages P-1 and P on one device: no transfer between them
        return comm if stage_device(schedule, a, P) != stage_device(schedule, b, P) else 0.0

    for e in tl.events:
        assert e.device == stage_device(schedule, e.stage, P)
        if e.kind == "F" and e.stage > 0:
            assert e.start >= by[("F", e.microbatch, e.stage - 1)].end + hop(e.stage - 1, e.stage) - 1e-9
        if e.kind in ("B", "I"):
            assert e.start >= by[("F", e.microbatch, e.stage)].end - 1e-9
            if e.stage < last:
                assert e.start >= by[(grad, e.microbatch, e.stage + 1)].end + hop(e.stage + 1, e.stage) - 1e-9
        if e.kind == "W":
            assert e.start >= by[("I", e.microbatch, e.stage)].end - 1e-9
    for d in range(P):
        evs = tl.device_events(d)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(evs, evs[1:]))
        assert tl.metrics["busy"][d] == pytest.approx(sum(e.duration for e in evs))


# ---------------------------------------------------------------- torch's own orders

schedules_mod = pytest.importorskip("torch.distributed.pipelining.schedules")


class _RecordingStage:
    """Just enough of _PipelineStageBase for PipelineScheduleSingle._step_microbatches: no comms, records compute."""

    def __init__(self, stage_index: int, num_stages: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.log: list[tuple[str, int, int]] = []

    def _no_ops(self, *args, **kwargs):
        return []  # no P2P ops -> _batch_p2p / _sorted_batch_p2p do nothing

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(("F", mb, self.stage_index))

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(("B", mb, self.stage_index))

    def perform_reduce_grad(self, *args, **kwargs):
        pass


def _torch_executed_order(cls, P: int, M: int) -> dict[int, list[tuple[str, int, int]]]:
    """Run torch's real _step_microbatches loop for each rank with a recording stage."""
    out = {}
    for rank in range(P):
        stage = _RecordingStage(rank, P)
        sched = cls(stage, M)
        sched._initialize_stage = lambda *a, **k: None  # shape inference needs real tensors; not the order
        sched._step_microbatches()
        out[rank] = stage.log
    return out


def _compute(actions) -> list[tuple[str, int, int]]:
    """Torch _Action list -> (F/B, micro-batch, stage), idle None and non-compute actions dropped."""
    keep = {schedules_mod._ComputationType.FORWARD: "F", schedules_mod._ComputationType.FULL_BACKWARD: "B"}
    return [(keep[a.computation_type], a.microbatch_index, a.stage_index) for a in actions if a is not None and a.computation_type in keep]


def _ours(schedule: str, P: int, M: int, V: int = 1) -> dict[int, list[tuple[str, int, int]]]:
    return {d: [(a.kind, a.microbatch, a.stage) for a in acts] for d, acts in device_orders(schedule, P, M, V).items()}


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
def test_gpipe_order_matches_torch(P, M):
    ours = _ours("gpipe", P, M)
    assert ours == _torch_executed_order(schedules_mod.ScheduleGPipe, P, M)
    ir = schedules_mod.ScheduleGPipe(SimpleNamespace(num_stages=P), M).pipeline_order
    assert {r: _compute(a) for r, a in ir.items()} == ours


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
def test_1f1b_order_matches_torch(P, M):
    if M < P:  # torch's Schedule1F1B refuses M < P; ours warms up min(M, P-i): stage 0 runs GPipe's order
        with pytest.raises(ValueError):
            schedules_mod.Schedule1F1B(_RecordingStage(0, P), M)
        assert _ours("1f1b", P, M)[0] == _ours("gpipe", P, M)[0]
        return
    ours = _ours("1f1b", P, M)
    assert ours == _torch_executed_order(schedules_mod.Schedule1F1B, P, M)
    # The static IR agrees except on the last rank, where torch 2.13's _get_pipeline_order
    # starts at F1 and ends at F{M} (off by one); the executed loop above runs F0..F{M-1}.
    ir = schedules_mod.Schedule1F1B(SimpleNamespace(num_stages=P), M).pipeline_order
    for r in range(P - 1):
        assert _compute(ir[r]) == ours[r]


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("V", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaved_order_matches_torch(P, V, k):
    M = k * P
    stages = [SimpleNamespace(num_stages=P * V, group_size=P, group_rank=0, stage_index=v * P) for v in range(V)]
    sched = schedules_mod.ScheduleInterleaved1F1B(stages, M)
    ours = _ours("interleaved-1f1b", P, M, V)
    assert {r: _compute(a) for r, a in sched.pipeline_order.items()} == ours
    # what the runtime executes after lowering (unshard/reshard, send/recv, reduce-grad added)
    assert {r: _compute(a) for r, a in sched.pipeline_order_with_comms.items()} == ours


ZBV_PM = [(P, M) for P in [1, *PS] for M in sorted({*MS, 2 * P - 1, 2 * P, 3 * P})]


@pytest.mark.parametrize("P,M", ZBV_PM)
def test_zbv_order_matches_torch(P, M):
    """ScheduleZBVZeroBubble's F/I/W order per rank, as built (the IR, micro-batches >= M dropped) and as lowered for
    the runtime (send/recv and reduce-grad actions added around the same compute), and its V stage placement."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    keep = {schedules_mod._ComputationType.FORWARD: "F", schedules_mod._ComputationType.BACKWARD_INPUT: "I",
            schedules_mod._ComputationType.BACKWARD_WEIGHT: "W", schedules_mod._ComputationType.FULL_BACKWARD: "B"}

    def compute(actions):
        return [(keep[a.computation_type], a.microbatch_index, a.stage_index) for a in actions if a is not None and a.computation_type in keep]

    # submod=None: torch's check that no stage module is compiled skips a stage without one
    stages = [SimpleNamespace(num_stages=2 * P, group_size=P, group_rank=0, stage_index=s, submod=None) for s in (0, 2 * P - 1)]
    sched = schedules_mod.ScheduleZBVZeroBubble(stages, M)
    ours = _ours("zbv", P, M)
    assert {r: compute(a) for r, a in sched.pipeline_order.items()} == ours
    assert {r: compute(a) for r, a in sched.pipeline_order_with_comms.items()} == ours
    assert generate_stage_to_rank_mapping(P, 2 * P, style="v") == {s: stage_device("zbv", s, P) for s in range(2 * P)}
    assert sched.stage_index_to_group_rank == {s: stage_device("zbv", s, P) for s in range(2 * P)}
    # every device runs F, I and W once per micro-batch on each of its two stages
    for d, acts in ours.items():
        assert sorted(acts) == sorted((k, m, s) for k in "FIW" for m in range(M) for s in (d, 2 * P - 1 - d))


# ---------------------------------------------------------------- diagrams and terminal output


def _png_stats(path):
    import matplotlib.image as mpimg

    img = mpimg.imread(path)[..., :3]
    colours = np.unique((img.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0)
    non_white = float((img.min(axis=2) < 0.95).mean())
    return len(colours), non_white


def test_timeline_diagram(tmp_path):
    tl = simulate("interleaved-1f1b", 4, 8, chunks=2)
    files = render_timeline(tl, tmp_path / "tl")
    assert {f.suffix for f in files} == {".png", ".svg"}
    n_colours, non_white = _png_stats(tmp_path / "tl.png")
    assert n_colours >= 20 and non_white > 0.2
    svg = (tmp_path / "tl.svg").read_text()
    # matplotlib writes each Rectangle as <g id="patch_N"><path .../></g>, not <rect>
    assert len(re.findall(r'id="patch_\d+"', svg)) >= len(tl.events) + tl.stages
    assert "Interleaved 1F1B" in svg and "utilisation" in svg


def test_zbv_timeline_diagram(tmp_path):
    """ZBV draws its input gradients orange and its weight gradients green, labelled I<n> and W<n>."""
    tl = simulate("zbv", 4, 8)
    render_timeline(tl, tmp_path / "zbv")
    svg = (tmp_path / "zbv.svg").read_text()
    assert "Zero-bubble V (ZBV)" in svg and "weight gradient (W)" in svg and "input gradient (I)" in svg
    drawn = [e for e in tl.events if e.duration > 0]  # the first stage's empty I's are not drawn
    assert len(re.findall(r'id="patch_\d+"', svg)) >= len(drawn) + tl.stages
    assert "#31a354" in svg and "#e6550d" in svg  # W green, I orange (chunk 0)


def test_tutorial_diagrams(tmp_path):
    files = tutorial_diagrams(tmp_path)
    assert len(files) == 10
    for f in files:
        if f.suffix == ".png":
            n_colours, non_white = _png_stats(f)
            assert n_colours >= 10 and non_white > 0.1, f
        else:
            assert len(re.findall(r'id="patch_\d+"', f.read_text())) >= 8, f
    assert "25%" in (tmp_path / "tutorial_1_naive.svg").read_text()


def test_ascii_timeline():
    tl = simulate("1f1b", 4, 8)
    text = tl.ascii()
    rows = [r for r in text.splitlines() if r.startswith("dev")]
    assert len(rows) == 4
    for row in rows:  # 1 cell = 1 time unit: M forward cells, 2M backward cells, rest idle
        cells = re.findall(r"[FB.]\d*", row.split("|")[1].replace(" ", ""))
        assert len(cells) == tl.makespan
        assert sum(c.startswith("F") for c in cells) == 8 and sum(c.startswith("B") for c in cells) == 16
    assert rows[0].split("|")[1].startswith("F0F1F2F3.")


def test_ascii_timeline_zbv():
    text = simulate("zbv", 2, 4).ascii()
    rows = [r for r in text.splitlines() if r.startswith("dev")]
    assert "I/W = input/weight gradient" in text
    for row in rows:  # 1 cell = 0.5 time units: each of 2 chunks x 4 micro-batches shows F, and W (I too, but stage 0's)
        cells = re.findall(r"[FIWfiw.]\d*", row.split("|")[1].replace(" ", ""))
        assert {c[0] for c in cells} <= set("FIWfiw.") and sum(c[0] in "Ff" for c in cells) == 8
    assert rows[0].split("|")[1].startswith("F0F1F2f0i0w0")  # torch's order on rank 0: 3 warm-up forwards, then stage 3


# ---------------------------------------------------------------- bad inputs and CLI


@pytest.mark.parametrize(
    "args,words",
    [
        (["--stages", "4", "--layers", "3"], ("4 stages", "3 layers")),
        (["--microbatches", "0"], ("microbatches",)),
        (["--stages", "0"], ("stages",)),
        (["--schedule", "zigzag"], ("unknown", "zigzag")),
        (["--schedule", "interleaved-1f1b", "--chunks", "2", "--stages", "4", "--microbatches", "6"], ("divisible",)),
        (["--stages", "4", "--fwd", "1,2,3"], ("fwd", "3", "4 stages")),
        (["--stages", "3", "--bwd", "1,2,3,4"], ("bwd", "4", "3 stages")),
        (["--schedule", "zbv", "--chunks", "3"], ("zbv always places 2 stages",)),
        (["--schedule", "zbv", "--stages", "4", "--layers", "6"], ("4 stages x 2 chunks", "6 layers")),
        (["--schedule", "zbv", "--stages", "2", "--fwd", "1,2,3"], ("fwd", "3", "2 stages", "4 virtual stages")),
        (["--schedule", "zbv", "--wgrad", "1.5"], ("wgrad", "between 0 and 1")),
        (["--schedule", "1f1b", "--wgrad", "0.5"], ("wgrad", "not 1f1b")),
    ],
)
def test_bad_inputs_are_one_line_errors(args, words, capsys):
    from shardlab.cli import main

    assert main(["pipeline", "simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "(fix:" in err
    assert all(w.lower() in err.lower() for w in words), err


def test_library_raises_user_error():
    with pytest.raises(UserError):
        simulate("1f1b", 4, 8, fwd=[1, 1])
    with pytest.raises(UserError):
        simulate("gpipe", 8, 4, layers=6)


def test_cli_end_to_end(tmp_path, capsys):
    from shardlab.cli import main

    out = tmp_path / "ps"
    assert main(["pipeline", "simulate", "--stages", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(out), "--no-tutorial"]) == 0
    text = capsys.readouterr().out
    assert "bubble 27.27%" in text and "dev3 |" in text
    assert (out / "timeline.png").exists() and (out / "timeline.svg").exists() and (out / "timeline.json").exists()
