"""User mistakes: one line on stderr starting with `error:`, a non-zero exit, no traceback, no run dir.

Each bad input goes through `shardlab.cli.main`, the function `python -m shardlab` calls, in this process (stdout and
stderr sent to files, as a terminal-less run has them): preflight errors need no worker, and a process per case cost
~2 minutes of the fast tier in interpreter and torch start-ups. Two cases run as real processes beside them, so the
entry point itself is covered: one bad input through `python -m shardlab`, and the CUDA out-of-memory report.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from zygote import run_shardlab

from shardlab.errors import OutOfMemory, UserError

# Short, cheap runs in case an error does *not* fire: then the test fails quickly instead of training an epoch.
QUICK = ["--max-steps", "2", "--seq-len", "64"]


@dataclass
class Case:
    args: list[str]
    words: tuple[str, ...]  # must all appear in the error line (case-insensitive)
    out: Path | None = None
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""


def _inputs(d: Path) -> dict[str, Path]:
    files = {
        "unknown_key.yaml": "model: tiny-gpt2\nmicro_batchsize: 2\n",
        "nested_key.yaml": "dataset:\n  sorce: offline\n",
        "wrong_type.yaml": "micro_batch: two\n",
        "bad_syntax.yaml": "model: [tiny-gpt2\n",
        "empty.txt": "",
        "no_qa_fields.jsonl": '{"text": "a plain line"}\n{"text": "another"}\n',
        "a_file": "not a directory\n",
    }
    out = {}
    for name, text in files.items():
        (d / name).write_text(text)
        out[name] = d / name
    return out


def _cases(f: dict[str, Path]) -> dict[str, Case]:
    return {
        "unknown_strategy": Case(["--strategy", "zero9"], ("unknown strategy", "zero9", "zero3", "fsdp")),
        "preset_typo": Case(["--model", "tiny_gpt2"], ("tiny_gpt2", "did you mean", "'tiny-gpt2'")),
        "unknown_yaml_key": Case(["--config", str(f["unknown_key.yaml"])], ("unknown config key", "micro_batchsize")),
        "unknown_nested_key": Case(["--config", str(f["nested_key.yaml"])], ("unknown config key", "dataset.sorce")),
        "unknown_set_key": Case(["--set", "strategy_options.pin_mem=false"], ("unknown config key", "strategy_options.pin_mem")),
        "unknown_flag": Case(["--micro-batchsize", "2"], ("unrecognized arguments: --micro-batchsize 2", "shardlab train --help")),
        "bad_yaml_syntax": Case(["--config", str(f["bad_syntax.yaml"])], ("not valid yaml", "line")),
        "wrong_type_flag": Case(["--micro-batch", "x"], ("--micro-batch", "positive integer or 'auto'", "'x'")),
        "wrong_type_yaml": Case(["--config", str(f["wrong_type.yaml"])], ("micro_batch", "integer", "'two'")),
        "batch_triple_mismatch": Case(["--micro-batch", "2", "--grad-accum", "2", "--global-batch", "5"], ("batch sizes disagree", "= 4", "global_batch is 5")),
        "global_not_divisible_by_world": Case(["--gpus", "2", "--global-batch", "3"], ("global_batch 3", "not divisible", "world size 2")),
        "seq_len_above_positions": Case(["--seq-len", "2048"], ("seq_len 2048", "tiny-gpt2", "1024 positions")),
        "dataset_missing": Case(["--dataset", str(f["empty.txt"].parent / "no" / "such.txt")], ("dataset path", "does not exist", "such.txt")),
        "dataset_empty": Case(["--dataset", str(f["empty.txt"])], ("empty.txt", "is empty")),
        "qa_without_fields": Case(["--dataset", str(f["no_qa_fields.jsonl"]), "--format", "qa"], ("qa data", "lacks field", "question", "context", "answer")),
        "model_not_offline": Case(["--model", "someone/not-a-model"], ("someone/not-a-model", "not available offline", "HF_HOME")),
        "nvme_is_a_file": Case(["--strategy", "infinity", "--nvme-path", str(f["a_file"])], ("nvme path", "a_file", "not writable")),
        "nvme_under_a_file": Case(["--strategy", "infinity", "--nvme-path", str(f["a_file"] / "swap")], ("nvme path", "not writable")),
        "nvme_missing": Case(["--strategy", "infinity"], ("infinity", "needs an nvme directory", "--nvme-path")),
        "cuda_without_gpu": Case(["--gpus", "4", "--device", "cuda"], ("cuda", "no cuda gpu")),
        "fp16_on_cpu": Case(["--precision", "fp16"], ("fp16", "not supported on cpu")),
        "compile_with_pipeline": Case(["--strategy", "pipeline", "--gpus", "2", "--microbatches", "2", "--compile"], ("--compile", "pipeline")),
    }


OOM_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import shardlab.loop.trainer as t
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    t.Trainer._loop = oom  # what a too-large micro batch does to the first step on a GPU
    from shardlab.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)


def _main_in_process(argv: list[str]) -> tuple[int | None, str, str]:
    """`shardlab.cli.main(argv)` with stdout/stderr sent to real files (faulthandler needs a file descriptor).
    The library restores os.environ after an in-process run itself (launch/launcher.train; tests/test_process_hygiene.py
    checks it); the patch here only keeps a bad case that fails before that point from leaking into the next one."""
    from shardlab.cli import main

    with mock.patch.dict(os.environ), tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        except SystemExit as exc:  # argparse exits
            code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        out.seek(0), err.seek(0)
        return code, out.read(), err.read()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    cases = _cases(_inputs(d))
    if torch.cuda.is_available():
        del cases["cuda_without_gpu"]
    for name, case in cases.items():
        case.out = d / f"out-{name}"
    # The real processes start first and run while the in-process cases go through main() one by one.
    cases["oom"] = Case(["--micro-batch", "2", "--grad-accum", "2"], ("out of memory", "strategy dp", "micro batch 2"), out=d / "out-oom")
    cases["unknown_strategy_process"] = Case(cases["unknown_strategy"].args, cases["unknown_strategy"].words,
                                             out=d / "out-unknown_strategy_process")
    jobs = {
        "oom": [sys.executable, "-c", OOM_SCRIPT, "train", *QUICK, *cases["oom"].args, "--no-export", "--output-dir", str(d / "out-oom")],
        "unknown_strategy_process": [sys.executable, "-m", "shardlab", "train", *QUICK, *cases["unknown_strategy"].args,
                                     "--output-dir", str(cases["unknown_strategy_process"].out)],
    }
    env = dict(os.environ)
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = {name: pool.submit(_run, cmd, env) for name, cmd in jobs.items()}
        for name, case in cases.items():
            if name not in jobs:
                case.returncode, case.stdout, case.stderr = _main_in_process(["train", *QUICK, *case.args, "--output-dir", str(case.out)])
        for name, fut in procs.items():
            proc = fut.result()
            cases[name].returncode, cases[name].stdout, cases[name].stderr = proc.returncode, proc.stdout, proc.stderr
    return cases


def assert_one_line_error(case: Case) -> str:
    lines = [line for line in case.stderr.splitlines() if line.strip()]
    detail = f"args {case.args}\nstderr:\n{case.stderr[-3000:]}\nstdout:\n{case.stdout[-1000:]}"
    assert case.returncode not in (0, None), detail
    assert "Traceback" not in case.stderr, detail
    assert len(lines) == 1 and lines[0].startswith("error: "), detail
    line = lines[0].lower()
    for word in case.words:
        assert word.lower() in line, f"{word!r} missing from the error line: {lines[0]}"
    return lines[0]


NAMES = [
    "unknown_strategy", "preset_typo", "unknown_yaml_key", "unknown_nested_key", "unknown_set_key", "bad_yaml_syntax",
    "wrong_type_flag", "wrong_type_yaml", "batch_triple_mismatch", "global_not_divisible_by_world", "seq_len_above_positions",
    "dataset_missing", "dataset_empty", "qa_without_fields", "model_not_offline", "nvme_is_a_file", "nvme_under_a_file",
    "nvme_missing", "cuda_without_gpu", "fp16_on_cpu", "compile_with_pipeline", "unknown_strategy_process",
]  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_one_line_error_and_no_run_dir(results, name):
    if name not in results:
        pytest.skip("a CUDA GPU is visible, so --device cuda is not an error here")
    case = results[name]
    line = assert_one_line_error(case)
    assert case.returncode == 2
    assert "(fix: " in line  # every error says how to fix it
    assert not case.out.exists(), f"{name}: the output dir was created (half-written run)"


@pytest.mark.slow
def test_error_from_rank_0_data_in_a_two_rank_run(tmp_path):
    """Multi-rank: rank 0 cannot build the data; rank 1 must not die with a traceback in a barrier. The bad input is
    the `qa_without_fields` case's, written here: the module's `results` fixture (every case, two real interpreters
    among them) was built in the slow tier for this test alone. The command is forked from the session's zygote
    (tests/zygote.py): the error lines asserted here are the launcher's, inside `shardlab train`; the real entry point
    is the fast tier's `unknown_strategy_process` case."""
    case = Case(_cases(_inputs(tmp_path))["qa_without_fields"].args + ["--gpus", "2"], ("qa data", "lacks field"), out=tmp_path / "out-qa2")
    proc = run_shardlab(["train", *QUICK, *case.args, "--output-dir", str(case.out)], timeout=300)
    case.returncode, case.stdout, case.stderr = proc.returncode, proc.stdout, proc.stderr
    detail = case.stderr[-3000:]
    assert case.returncode == 2, detail
    assert "Traceback" not in case.stderr, detail
    errors = [line for line in case.stderr.splitlines() if "error: " in line]
    assert any(line.startswith("error: QA data") and "lacks field" in line for line in errors), detail
    assert errors[-1].startswith("error: a worker process failed with exit code 2"), detail
    assert not case.out.exists()


def test_cuda_oom_is_reported_with_next_steps(results):
    case = results["oom"]
    line = assert_one_line_error(case)
    assert case.returncode == OutOfMemory.exit_code == 3
    assert "--micro-batch 1 with --grad-accum 4" in line and "--gradient-checkpointing" in line
    assert "(zero2)" in line  # the next strategy after dp that shards more


# ---- in-process: the pieces behind the messages ---------------------------------------------------------


def test_bf16_on_a_gpu_without_it():
    from shardlab.runtime.resolved import resolve_precision

    with pytest.raises(UserError, match="bf16") as err:
        resolve_precision("bf16", "cuda", bf16_supported=False)
    assert "fp16" in str(err.value) and "fix:" in str(err.value)
    assert resolve_precision("bf16", "cuda", bf16_supported=True).name == "bf16"
    assert resolve_precision("auto", "cuda", bf16_supported=False).name == "fp16"
    assert resolve_precision("auto", "cuda", bf16_supported=True).name == "bf16"
    assert resolve_precision("auto", "cpu").name == "fp32"
    with pytest.raises(UserError, match="fp16 training is not supported on CPU"):
        resolve_precision("fp16", "cpu")


def test_out_of_memory_is_a_user_error_with_its_own_exit_code():
    assert issubclass(OutOfMemory, UserError)
    assert OutOfMemory.exit_code == 3 and UserError.exit_code == 2
    err = OutOfMemory("CUDA out of memory\nat step 1.", "try --micro-batch 1\nor zero3")
    assert str(err) == "CUDA out of memory at step 1 (fix: try --micro-batch 1 or zero3)"  # one line


def test_next_strategy_suggestions_shard_more():
    from shardlab.config import STRATEGIES
    from shardlab.loop.trainer import next_strategy

    assert next_strategy("dp") == "zero2"
    assert next_strategy("zero2") == "zero3"
    assert next_strategy("zero3") == "zero3_offload"
    assert next_strategy("zero3_offload") == "infinity"
    assert next_strategy("fsdp") == "fsdp_offload"
    assert next_strategy("fsdp_offload") == "zero3_offload"
    for name in STRATEGIES:
        assert next_strategy(name) != name or name == "infinity"
    assert next_strategy("infinity") == "more GPUs"


def test_nvme_path_not_writable_in_a_read_only_dir(tmp_path):
    from shardlab.strategies.deepspeed_machine import check_nvme_path

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:
            (ro / "probe").write_text("x")
        except OSError:
            pass
        else:
            pytest.skip("running as root: a read-only mode bit does not stop writes here (file-path cases cover it)")
        with pytest.raises(UserError, match="not writable"):
            check_nvme_path(str(ro / "swap"), 1000)
    finally:
        ro.chmod(0o755)


def test_error_lines_are_written_in_one_piece(monkeypatch):
    """Ranks share one stderr: a line and its newline in one write, or under PYTHONUNBUFFERED two ranks' lines can merge."""
    from shardlab.cli import report_errors

    writes: list[str] = []

    class Stderr:
        def write(self, text: str) -> None:
            writes.append(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    monkeypatch.setenv("RANK", "1")
    with report_errors() as status:
        raise UserError("rank 0 could not build the training data", "see rank 0's error")
    assert writes == ["[rank 1] error: rank 0 could not build the training data (fix: see rank 0's error)\n"] and status.code == 2
