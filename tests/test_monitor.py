"""The samplers: psutil over a real process tree (this test's allocations show up), NVML's absence, the CSV formats.

The end-to-end side (samplers started by the launcher of real `shardlab train` runs, ranks summed) is checked
on the quick bench's runs in test_bench_report.py.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardlab.measure import monitor
from shardlab.report.load import Run
from shardlab.report.tables import cpu_csv_stats, gpu_csv_stats
from shardlab.measure.summary import merge_monitor

MB = 10**6


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def wait_for_samples(sampler, n: int = 4, timeout: float = 60) -> None:
    """Until the sampler has taken N more samples: each phase below is sampled however late a loaded machine runs
    the sampler's thread (fixed sleeps left a phase without a sample)."""
    want, deadline = sampler.n_rows + n, time.monotonic() + timeout
    while sampler.n_rows < want:
        assert time.monotonic() < deadline, f"the sampler took {sampler.n_rows} samples, waiting for {want}"
        time.sleep(0.02)


def test_process_tree_rss_grows_when_this_test_and_its_child_allocate(tmp_path):
    out = tmp_path / "cpu_memory.csv"
    sampler = monitor.ProcessTreeSampler(out, interval=0.05).start()
    wait_for_samples(sampler)
    t_alloc = time.monotonic() - sampler.t0
    block = b"\x01" * (300 * MB)  # written, so resident
    wait_for_samples(sampler)
    t_child = time.monotonic() - sampler.t0
    # the child holds its 400 MB until its stdin closes, however long the sampling takes
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b'\\x01' * 400_000_000; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    wait_for_samples(sampler)
    t_end = time.monotonic() - sampler.t0
    child.stdin.close()
    child.wait(timeout=30)
    assert sampler.stop()
    del block

    header, rows = read_csv(out)
    assert header == monitor.CPU_COLUMNS == ["Elapsed time", "CPU (%)", "Real (MB)", "Virtual (MB)", "Processes"]
    t = [float(r["Elapsed time"]) for r in rows]
    real = [float(r["Real (MB)"]) for r in rows]
    procs = [int(r["Processes"]) for r in rows]
    assert t == sorted(t) and len(rows) >= 12
    before = max(r for ti, r in zip(t, real) if ti < t_alloc)
    alone = max(r for ti, r in zip(t, real) if t_alloc < ti < t_child)
    with_child = max(r for ti, r in zip(t, real) if t_child < ti < t_end)
    assert alone - before > 250, (before, alone)  # the 300 MB this process wrote
    assert with_child - alone > 350, (alone, with_child)  # plus the child's 400 MB: the tree is summed
    assert max(procs) >= procs[0] + 1  # the child joined the tree (which may hold the session's test zygote from the start)
    assert any(float(r["CPU (%)"]) > 10 for r in rows[1:])  # the child spent CPU writing 400 MB
    s = sampler.summary()
    assert s["real_mb"]["peak"] == pytest.approx(max(real)) and s["samples"] == len(rows) and s["max_processes"] == max(procs)


def test_nothing_is_written_until_the_run_directory_is_this_runs(tmp_path):
    run_dir = tmp_path / "run"
    mon = monitor.RunMonitor(run_dir, device_type="cpu", n_gpus=None, interval=0.05)
    time.sleep(0.2)
    assert not run_dir.exists()  # bad input must leave nothing behind: the monitor never creates the directory
    assert mon.finish() is None
    assert not run_dir.exists()


def test_run_monitor_streams_csv_and_merges_its_summary(tmp_path):
    run_dir = tmp_path / "run"
    mon = monitor.RunMonitor(run_dir, device_type="cpu", n_gpus=None, interval=0.05)
    time.sleep(0.15)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model: tiny-gpt2\n")  # what the trainer writes once its checks passed
    time.sleep(0.3)
    assert (run_dir / "cpu_memory.csv").is_file()  # streamed while the run goes on, start-up samples included
    (run_dir / "summary.json").write_text(json.dumps({"steps": 3}))  # what the trainer's rank 0 wrote
    result = mon.finish()
    assert json.loads((run_dir / "summary.json").read_text()) == {"steps": 3}  # the monitor writes no summary itself
    merge_monitor(run_dir, None, result)  # the launcher's one merge, once the run ended well
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["cpu_monitor"] == result["cpu_monitor"] and summary["cpu_monitor"]["available"]
    assert summary["gpu_monitor"] == {"available": False, "reason": "CPU run: no GPU to sample"}
    _, rows = read_csv(run_dir / "cpu_memory.csv")
    assert float(rows[0]["Elapsed time"]) == 0.0 and len(rows) == summary["cpu_monitor"]["samples"]
    assert summary["cpu_monitor"]["real_mb"]["peak"] == pytest.approx(max(float(r["Real (MB)"]) for r in rows))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_no_gpu_means_no_gpu_sampler_and_a_reason(tmp_path):
    sampler, why = monitor.start_gpu_sampler(tmp_path / "gpu_memory.csv", None, 0.1, lambda: True)
    assert sampler is None
    assert "NVML" in why or "no GPU" in why
    assert not (tmp_path / "gpu_memory.csv").exists()


class FakeNvml:
    """Two GPUs whose memory.used climbs by 100 MiB per read: checks the CSV layout and the summaries, not NVML."""

    def __init__(self):
        self.reads = {0: 0, 1: 0}
        self.closed = False

    def handles(self, visible):
        return [(0, 0), (1, 1)]

    def read(self, handle):
        self.reads[handle] += 1
        used = 1000.0 * (handle + 1) + 100.0 * self.reads[handle]
        return "Fake GPU 80GB", used, 81559.0, 50.0 + handle

    def close(self):
        self.closed = True


def test_gpu_csv_has_nvidia_smi_columns_and_the_summaries_agree_with_it(tmp_path):
    fake = FakeNvml()
    sampler, why = monitor.start_gpu_sampler(tmp_path / "gpu_memory.csv", None, 0.02, lambda: True, nvml_factory=lambda: fake)
    assert why is None
    time.sleep(0.25)
    assert sampler.stop() and fake.closed
    header, rows = read_csv(tmp_path / "gpu_memory.csv")
    assert header == ["timestamp", "index", "name", "memory.used [MiB]", "memory.total [MiB]", "utilization.gpu [%]"]
    assert {r["index"] for r in rows} == {"0", "1"} and rows[0]["name"] == "Fake GPU 80GB"
    assert rows[0]["timestamp"] == rows[1]["timestamp"]  # one timestamp per sample, one row per GPU
    used = {i: [float(r["memory.used [MiB]"]) for r in rows if r["index"] == str(i)] for i in (0, 1)}
    s = sampler.summary()
    assert s["memory_used_mib"]["peak"] == max(used[1])  # the busiest GPU
    assert s["memory_used_mib"]["min"] == min(used[0])
    assert s["memory_used_mib"]["mean"] == pytest.approx((sum(used[0]) / len(used[0]) + sum(used[1]) / len(used[1])) / 2)
    assert s["utilization_pct"]["mean"] == pytest.approx(50.5)
    # the report reads the CSV itself and gets the same peak / mean / min
    from_csv = gpu_csv_stats(Run(tmp_path, {}, {}))
    assert from_csv["peak"] == pytest.approx(s["memory_used_mib"]["peak"] / 1024)
    assert from_csv["mean"] == pytest.approx(s["memory_used_mib"]["mean"] / 1024)
    assert from_csv["min"] == pytest.approx(s["memory_used_mib"]["min"] / 1024)


def test_visible_devices_map_to_nvml_handles(monkeypatch):
    class NV:
        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):  # noqa: N802 - pynvml's name
            return f"index {i}"

        @staticmethod
        def nvmlDeviceGetHandleByUUID(u):  # noqa: N802
            return f"uuid {u}"

    nvml = monitor.Nvml.__new__(monitor.Nvml)
    nvml.nv = NV
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-8f1c,MIG-1")
    assert nvml.handles(monitor.visible_devices()) == [(0, "index 3"), (1, "uuid GPU-8f1c")]


def test_cpu_csv_stats_of_a_psrecord_file(tmp_path):
    (tmp_path / "cpu_memory.csv").write_text("Elapsed time,CPU (%),Real (MB),Virtual (MB),Processes\n"
                                             "0.0,0.0,100,400,1\n0.5,150.0,300,900,3\n1.0,50.0,200,800,3\n")
    s = cpu_csv_stats(Run(tmp_path, {}, {}))
    assert s["real_peak"] == 0.3 and s["real_mean"] == pytest.approx(0.2) and s["virtual_peak"] == 0.9
    assert s["cpu_mean"] == 100.0 and s["cpu_peak"] == 150.0  # the first sample has no interval: not counted


def test_a_failed_child_process_does_not_stop_the_sampler(tmp_path):
    sampler = monitor.ProcessTreeSampler(tmp_path / "cpu.csv", interval=0.02).start()
    for _ in range(5):  # short-lived children vanish between listing and reading: skipped, never raised
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert sampler.stop()
    assert sampler.error is None or "NoSuchProcess" in sampler.error
    assert os.path.getsize(tmp_path / "cpu.csv") > 0
