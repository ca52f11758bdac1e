"""A run is never silent: plain progress lines in a log file, and a one-line report when the kernel kills it.

The unit tests call the pieces in-process (the progress line, the supervisor with a stand-in child);
the two slow tests run the real `shardlab train` with stdout redirected to a file, once to the end and
once killed by SIGKILL (as the out-of-memory killer does) during its first checkpoint.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.measure.monitor import CPU_COLUMNS, CPU_CSV
from shardlab.launch.supervise import SUPERVISED_ENV, fix_for_kill, note_for_kill, supervise
from shardlab.loop.reporting import progress_line

ROW = {"step": 20, "epoch": 0.4, "loss": 3.21456, "lr": 4.5e-5, "tokens_per_s": 12345.6, "step_time_s": 0.512, "cpu_rss_gib": 1.25}


def test_progress_line_on_gpu_names_every_field():
    row = dict(ROW, gpu_mem_alloc_gib=12.25, gpu_mem_peak_gib=14.5)
    line = progress_line(row, 100, 41.0)
    assert line == ("[shardlab] step 20/100 | epoch 0.400 | loss 3.2146 | lr 4.50e-05 | 12,346 tokens/s | step 0.512 s | "
                    "GPU mem 12.25 GiB (peak 14.50) | ETA 00:00:41")


def test_progress_line_on_cpu_shows_host_memory_and_long_eta():
    line = progress_line(ROW, 100, 3 * 86400)
    assert "host RSS 1.25 GiB (rank 0)" in line and "GPU" not in line and line.endswith("ETA 3.0 days")


def _write_cpu_csv(run_dir: Path, real_mb: list[float]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / CPU_CSV, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CPU_COLUMNS)
        for i, mb in enumerate(real_mb):
            w.writerow([i * 0.5, 100.0, mb, 2 * mb, 1])


# A stand-in for the training process: leaves a plan where the supervisor looks, then dies as the OOM killer kills.
KILLED_CHILD = ("import json, os, signal; open(os.environ[%r], 'w').write(json.dumps({'cpu_gib': 2.75, 'strategy': 'zero2_offload'})); "
                "os.kill(os.getpid(), signal.SIGKILL)") % SUPERVISED_ENV


def test_supervisor_reports_a_sigkill_in_one_line_with_host_memory_plan_and_fix(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_cpu_csv(run_dir, [1000.0, 3221.2, 2000.0])  # peak 3221.2 MB = 3.0 GiB
    code = supervise(str(run_dir), "zero2_offload", [sys.executable, "-c", KILLED_CHILD])
    assert code == -signal.SIGKILL  # as Popen reports it; `shardlab train` then ends by the same signal (exit_as)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error: the training process (pid ") and "was killed by SIGKILL" in line
    assert "host memory" in line and "peaked at 3.0 GiB of " in line and str(run_dir / CPU_CSV) in line
    assert "the plan predicted 2.8 GiB of host memory" in line
    assert "--micro-batch" in line and "--no-pin-memory" in line and "more host RAM" in line


def test_supervisor_passes_the_childs_exit_status_through_silently(tmp_path, capfd):
    assert supervise(str(tmp_path), "dp", [sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert capfd.readouterr().err == ""


def test_the_supervised_command_times_its_start_up_from_the_supervisors_start(tmp_path, capfd):
    """`shardlab train` runs again as the supervisor's child: the child's time_to_first_step_s counts from the command's
    start (the supervisor's, or a launcher's above it), not from the child's own creation."""
    from shardlab.measure.compile_stats import START_ENV, process_start_time

    shown = f"import os; print(os.environ[{START_ENV!r}])"
    assert supervise(str(tmp_path), "dp", [sys.executable, "-c", shown]) == 0
    assert float(capfd.readouterr().out) == process_start_time()


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGABRT, 3])
def test_the_supervisor_ends_as_its_child_ended(code):
    proc = subprocess.run([sys.executable, "-c", f"import sys; from shardlab.launch.supervise import exit_as; sys.exit(exit_as({code}))"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr


def test_kill_note_without_a_run_directory_or_plan(tmp_path):
    note, fix = note_for_kill(tmp_path / "never-made", None, None, "dp")
    assert "host memory of the run was not recorded (it died before its run directory existed)" in note and "peaked" not in note
    assert "plan" not in note and "--no-pin-memory" not in fix  # pinned buffers are an offload strategy's


def test_kill_fix_names_what_lowers_host_memory_per_strategy():
    assert "--strategy infinity" in fix_for_kill("zero3_offload")
    assert "--no-pin-memory" in fix_for_kill("infinity") and "--strategy infinity" not in fix_for_kill("infinity")


RUN = ["--model", "tiny-gpt2", "--device", "cpu", "--dataset", "synthetic", "--seq-len", "32", "--micro-batch", "2", "--no-export",
       "--set", "dataset.eval_samples=2"]  # the epoch-end eval of 312 blocks would take longer than the training


def _train_to_files(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str, Path]:
    """`shardlab train` with stdout and stderr redirected to files, as `nohup` or a SLURM job log does."""
    out = tmp_path / "run"
    with open(tmp_path / "stdout.log", "w") as fo, open(tmp_path / "stderr.log", "w") as fe:
        proc = subprocess.run([sys.executable, "-m", "shardlab", "train", *RUN, *args, "--output-dir", str(out)], stdout=fo, stderr=fe,
                              stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})), timeout=900)  # a guard only
    return proc.returncode, (tmp_path / "stdout.log").read_text(), (tmp_path / "stderr.log").read_text(), out


@pytest.mark.slow
def test_a_log_file_gets_one_plain_line_per_log_every_steps(tmp_path):
    code, stdout, stderr, _ = _train_to_files(tmp_path, ["--max-steps", "4", "--log-every", "2"])
    assert code == 0, stderr[-3000:]
    steps = re.findall(r"^\[shardlab\] step (\d+)/4 \| epoch [\d.]+ \| loss [\d.]+ \| lr \S+ \| [\d,]+ tokens/s \| step [\d.]+ s \| "
                       r"host RSS [\d.]+ GiB \(rank 0\) \| ETA \d\d:\d\d:\d\d$", stdout, re.M)
    assert steps == ["2", "4"], stdout
    assert "\r" not in stdout and "it/s" not in stdout + stderr  # no progress bar in a file
    assert re.search(r"│ MFU\s+│ .*no dense peak is known", stdout), stdout  # the final table names MFU (none on a CPU)


@pytest.mark.slow
def test_a_bug_in_a_forked_rank_prints_its_traceback(tmp_path):
    """A rank forked from the launcher (CPU runs) that raises something other than a user error: its traceback reaches
    stderr, as an exec'd rank's interpreter prints it; torch's fork context alone kept only the exit code."""
    code, _, stderr, _ = _train_to_files(tmp_path, ["--gpus", "2", "--max-steps", "3"], env={"SHARDLAB_FAULTS": "raise@2:1"})
    assert code == 1, stderr[-3000:]
    assert "Traceback (most recent call last)" in stderr
    assert "RuntimeError: deliberate fault in step 2 on rank 1 (SHARDLAB_FAULTS)" in stderr
    assert "error: a worker process failed with exit code 1 (rank 1" in stderr


@pytest.mark.slow
def test_a_sigkilled_single_process_run_is_reported_by_its_supervisor(tmp_path):
    # kill_in_save: the training process SIGKILLs itself while writing the checkpoint of step 2, as the OOM killer would.
    code, stdout, stderr, out = _train_to_files(tmp_path, ["--max-steps", "3", "--save-every", "2"], {"SHARDLAB_FAULTS": "kill_in_save@2"})
    assert code == -signal.SIGKILL, stderr[-3000:]  # the supervisor ends as its child did
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    line = errors[0]
    with open(out / CPU_CSV, newline="") as f:
        peak_gib = max(float(r["Real (MB)"]) for r in csv.DictReader(f)) * 1e6 / 2**30
    assert "was killed by SIGKILL" in line and f"host memory (process-tree RSS, {out / CPU_CSV}) peaked at {peak_gib:.1f} GiB" in line
    assert re.search(r"the plan predicted [\d.]+ GiB of host memory", line) and "(fix: " in line


def _ds_json(strategy: str, device_type: str, tmp_path: Path) -> dict:
    from shardlab.config import RunConfig
    from shardlab.strategies.deepspeed_config import resolved_ds_config

    cfg = RunConfig(strategy=strategy, strategy_options={"nvme_path": str(tmp_path)})
    return resolved_ds_config(cfg, "bf16" if device_type == "cuda" else "fp32", 2, 1, 2, device_type)


@pytest.mark.parametrize(("strategy", "device_type", "optimizer_ops"), [
    ("zero2", "cuda", ["FusedAdamBuilder"]),
    ("zero2_offload", "cuda", ["CPUAdamBuilder"]),
    ("infinity", "cuda", ["CPUAdamBuilder", "AsyncIOBuilder"]),
    ("zero2", "cpu", []),  # torch's AdamW on a CPU without offload: no DeepSpeed optimizer kernel
    ("zero3_offload", "cpu", ["CPUAdamBuilder"]),
])
def test_op_builders_are_the_ones_deepspeed_loads(strategy, device_type, optimizer_ops, tmp_path):
    from shardlab.strategies.deepspeed_machine import op_builders

    assert op_builders(_ds_json(strategy, device_type, tmp_path)) == [*optimizer_ops, "ShareMemCommBuilder"]


def test_an_op_build_is_announced_unless_torch_cached_it(tmp_path, monkeypatch):
    from shardlab.strategies.deepspeed_machine import announce_op_builds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # an empty cache: nothing built yet
    ds = _ds_json("infinity", "cpu", tmp_path)
    lines: list[str] = []
    announce_op_builds(ds, lines.append)
    assert [line.split()[3] for line in lines] == ["cpu_adam", "async_io", "deepspeed_shm_comm"], lines
    assert all("the first build on this machine takes minutes" in line and str(tmp_path / "ext") in line for line in lines)
    (tmp_path / "ext" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # what torch's `load` leaves after a build
    lines.clear()
    announce_op_builds(ds, lines.append)
    assert [line.split()[3] for line in lines] == ["async_io", "deepspeed_shm_comm"], lines
