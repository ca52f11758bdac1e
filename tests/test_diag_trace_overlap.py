"""benchmarks/diag/trace_overlap.py on a made-up Chrome trace whose answer is known: the GPU idles 2 ms because the
CPU launched the next kernel late, from inside DDP's forward."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks/diag/trace_overlap.py"


def _load():
    spec = importlib.util.spec_from_file_location("trace_overlap", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


@pytest.fixture
def trace(tmp_path):
    events = [
        _x("ProfilerStep#4", "user_annotation", 0, 10_000),
        _x("ampere_gemm", "kernel", 0, 3_000, tid=7, correlation=1),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 2_000, 2_000, tid=8, correlation=2),
        _x("ampere_gemm", "kernel", 6_000, 3_000, tid=7, correlation=3),
        _x("cudaLaunchKernel", "cuda_runtime", 100, 10, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 5_900, 10, correlation=3),
        _x("aten::item", "cpu_op", 3_900, 1_800),
        _x("DistributedDataParallel.forward", "python_function", 5_000, 4_000),
        _x("aten::mm", "cpu_op", 5_800, 150),
    ]
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_an_idle_gap_is_charged_to_the_cpu_code_that_launched_the_kernel_ending_it(trace):
    mod = _load()
    found = mod.gaps(mod.load(trace), min_gap_us=500)
    assert len(found) == 2
    step, at, dur, before, after, launcher, late = found[0]
    assert (step, at, dur) == ("ProfilerStep#4", 4_000, 2_000)
    assert before.startswith("ncclDevKernel") and after == "ampere_gemm"
    assert launcher == "DistributedDataParallel.forward > aten::mm" and late == 1_900
    assert found[1][1:3] == (9_000, 1_000) and found[1][4] == "(step end)"


def test_shorter_gaps_than_asked_are_left_out(trace):
    mod = _load()
    assert len(mod.gaps(mod.load(trace), min_gap_us=1_500)) == 1


def test_the_summary_prints_compute_nccl_and_idle(trace, capsys):
    _load().main(str(trace), 500)
    out = capsys.readouterr().out
    assert "wall 10.0 ms | compute 6.0 | nccl 2.0 (exposed 1.0) | gpu idle 3.0 ms" in out
    assert "DistributedDataParallel.forward > aten::mm" in out
