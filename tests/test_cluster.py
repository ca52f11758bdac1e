"""Cluster life on CPU, with real processes: kill -9 and preemption then exact resume, two nodes on localhost,
a dead or hung rank, the NaN guard, elastic resume across strategies and world sizes, export of every
strategy's checkpoint, and a job submitted to a real local SLURM (slurmctld + slurmd + munged).

Two uninterrupted references, each run once per module:
  REF   dp on 2 ranks, dropout 0.1 (so resume must restore every rank's RNG), 14 steps over 3 short epochs
  REF0  dp on 1 rank (micro 2 x accum 2), dropout 0 (elastic resume changes the ranks, whose RNG streams cannot carry over)
All runs are fp32 on CPU with the same seed, data and global batch 4.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from patience import patience
from slurm_cluster import LocalSlurm, missing_reason
from zygote import popen_shardlab, run_shardlab

from shardlab.runtime.distributed import free_port

BASE = ["--model", "tiny-gpt2", "--dataset", "offline", "--device", "cpu", "--seq-len", "64", "--precision", "fp32",
        "--log-every", "1", "--lr", "1e-3", "--lr-schedule", "constant", "--seed", "7", "--set", "dataset.eval_samples=1",
        "--num-samples", "8", "--global-batch", "4", "--micro-batch", "2"]  # fmt: skip  (25 train blocks: 6 steps per epoch)
RESUME = [*BASE, "--dropout", "0.1", "--max-steps", "14", "--save-every", "2", "--no-export"]
ELASTIC = [*BASE, "--dropout", "0", "--save-every", "4", "--eval-every", "4", "--keep-checkpoints", "5"]
TIMEOUT = 300

pytestmark = pytest.mark.slow  # every test here runs several ranks, nodes or launches (conftest.py: the tiers)


class Run:
    """`python -m shardlab train ARGS` as a background process, its output in files beside the run dir. The process is
    the training itself (no supervising parent: zygote.py), so a signal sent to `proc` reaches the launcher."""

    def __init__(self, args: list[str], out: Path, env: dict[str, str] | None = None, tag: str = "", popen=popen_shardlab):
        self.out = out
        log = out.parent / f"{out.name}{tag}"
        self.stdout_path, self.stderr_path = Path(f"{log}.stdout"), Path(f"{log}.stderr")
        self.args = [*args, "--output-dir", str(out)]
        # forked from the session's zygote (zygote.py): a fresh `shardlab train` process without ~8 s of imports;
        # `popen` (same arguments as popen_shardlab) may start a real interpreter instead (tests/test_two_nodes_gpu.py)
        self.proc = popen(["train", *self.args], self.stdout_path, self.stderr_path,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.rc: int | None = None

    def wait(self, timeout: float = TIMEOUT) -> "Run":
        self.rc = self.proc.wait(timeout=patience(timeout))
        return self

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def ok(self) -> "Run":
        self.wait()
        assert self.rc == 0, f"shardlab {' '.join(self.args)} exited {self.rc} after logging step {last_step(self.out)}:\n{self.stderr[-8000:]}"
        return self

    def wait_for_step(self, step: int, timeout: float = TIMEOUT) -> None:
        deadline = time.time() + patience(timeout)  # a guard: the loop ends as soon as the run ends
        while time.time() < deadline:
            if last_step(self.out) >= step:
                return
            assert self.proc.poll() is None, f"run ended ({self.proc.returncode}) before step {step}:\n{self.stderr[-3000:]}"
            time.sleep(0.05)
        raise TimeoutError(f"step {step} not reached")

    def worker(self, rank: int) -> psutil.Process:
        """The worker process of global `rank` below this `shardlab train` (its supervisor, the launcher): named
        shardlab-r<RANK> when forked from the launcher (CPU runs: launch/worker.forked_main), RANK in its environment
        when exec'd."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.name() == f"shardlab-r{rank}" or child.environ().get("RANK") == str(rank):
                return child
        raise LookupError(f"no worker with RANK={rank}")


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def last_step(out: Path) -> int:
    return max((r["step"] for r in rows(out) if "loss" in r), default=0)


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(out) if "loss" in r}


def eval_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in rows(out) if "eval_loss" in r}


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range, rel: float) -> None:
    assert sorted(got) == list(steps), f"logged steps {sorted(got)}"
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=rel), f"step {s}: {got[s]!r} vs uninterrupted {want[s]!r}"


def latest(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="session")  # a directory: joins no xdist group (conftest.py)
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cluster")


@pytest.fixture(scope="module")
def ref_run(root) -> Run:
    """Started, not awaited: other runs start beside it (process start-up is single-threaded imports; 2 cores)."""
    return Run([*RESUME, "--gpus", "2"], root / "ref")


@pytest.fixture(scope="module")
def ref(ref_run) -> dict[int, float]:
    ref_run.ok()
    assert sorted(losses(ref_run.out)) == list(range(1, 15))
    return losses(ref_run.out)


# ---- kill -9 mid-epoch, kill -9 during a save, SIGTERM: every resume continues the uninterrupted run -------------


@pytest.fixture(scope="module")
def crash_chain(root, ref_run):
    """One run directory through three launches: rank 1 SIGKILLed mid-epoch (in step 6, by a fault: at a known step,
    whatever the machine's load); resumed, rank 1 SIGKILLed while the step-8 checkpoint is half-written; resumed to
    the end. (SIGTERM/SIGUSR1 preemption: the SLURM test.)"""
    out = root / "crash"
    a = Run([*RESUME, "--gpus", "2"], out, env={"SHARDLAB_FAULTS": "kill@6:1"}, tag="-a").wait()
    after_a = {"last_step": last_step(out), "latest": latest(out)}
    b = Run([*RESUME, "--gpus", "2", "--resume", "auto"], out, env={"SHARDLAB_FAULTS": "kill_in_save@8:1"}, tag="-b").wait()
    step6 = out / "checkpoints" / "step-0000006"
    after_b = {"latest": latest(out), "dirs": sorted(p.name for p in (out / "checkpoints").iterdir()),
               "step6_complete": (step6 / "trainer_state.json").is_file() and (step6 / "torch_dcp" / ".metadata").is_file()}  # fmt: skip
    # resumes from step 6, an epoch's last step: the next epoch's order and dropout masks must follow
    d = Run([*RESUME, "--gpus", "2", "--resume", "auto"], out, tag="-d").ok()
    return {"out": out, "a": a, "after_a": after_a, "b": b, "after_b": after_b, "d": d}


def test_kill9_mid_epoch_names_the_rank(crash_chain):
    a = crash_chain["a"]
    assert a.rc == 128 + signal.SIGKILL, a.stderr[-3000:]
    assert crash_chain["after_a"] == {"last_step": 5, "latest": "step-0000004"}  # it died in step 6
    assert re.search(r"error: rank 1 \(pid \d+\) was killed by SIGKILL", a.stderr), a.stderr[-3000:]  # not rank 0, which lost its peer
    assert "the host's out-of-memory killer" in a.stderr and "--micro-batch" in a.stderr  # the likely cause, and the fix


def test_kill9_during_save_leaves_the_last_checkpoint_intact(crash_chain):
    b, after = crash_chain["b"], crash_chain["after_b"]
    assert b.rc not in (0, None), b.stderr[-2000:]
    assert "was killed by SIGKILL" in b.stderr
    # the half-written step-8 checkpoint stays a .tmp directory; `latest` still names step 6, complete
    assert "step-0000008.tmp" in after["dirs"] and "step-0000008" not in after["dirs"]
    assert after["latest"] == "step-0000006"
    assert after["step6_complete"]


def test_resumed_losses_equal_the_uninterrupted_run(crash_chain, ref):
    d = crash_chain["d"]
    assert "resumed from" in d.stdout_path.read_text() and "step-0000006 at step 6" in d.stdout_path.read_text()
    assert_same_losses(losses(crash_chain["out"]), ref, range(1, 15), rel=1e-5)
    summary = json.loads((crash_chain["out"] / "summary.json").read_text())
    assert summary["steps"] == 14 and summary["epochs"][-1]["epoch"] == 2  # 3 epochs of 6 steps: the data order went on
    ckpt = crash_chain["out"] / "checkpoints" / latest(crash_chain["out"])
    assert {p.name for p in ckpt.iterdir()} >= {"rng_rank0.pt", "rng_rank1.pt", "config.yaml", "trainer_state.json", "torch_dcp"}
    assert not list((crash_chain["out"] / "checkpoints").glob("*.tmp"))  # the next save swept the half-written one
    assert len([p for p in (crash_chain["out"] / "checkpoints").iterdir() if p.is_dir()]) == 2  # keep_checkpoints


# ---- two nodes on localhost; a dead and a hung rank -------------------------------------------------------------


def two_nodes(args: list[str], root: Path, name: str, envs: tuple[dict, dict] = ({}, {}), popen=popen_shardlab) -> tuple[Run, Run]:
    """Nodes 0 and 1 of one job on localhost, each a `shardlab train` of its own; ``envs``: each node's extra variables."""
    port = str(free_port())
    node1 = Run([*args, "--nodes", "2", "--node-rank", "1", "--master-port", port], root / f"{name}-n1", env=envs[1], popen=popen)
    node0 = Run([*args, "--nodes", "2", "--node-rank", "0", "--master-port", port], root / f"{name}-n0", env=envs[0], popen=popen)
    return node0, node1


def test_two_nodes_match_one_node(root, ref):
    node0, node1 = two_nodes(RESUME, root, "2nodes")
    node0.ok(), node1.ok()
    assert "launching 1 worker(s) (forked from this launcher) on node 0 of 2" in node0.stdout_path.read_text()
    assert json.loads((node0.out / "summary.json").read_text())["world_size"] == 2
    assert_same_losses(losses(node0.out), ref, range(1, 15), rel=1e-6)


def test_dead_or_hung_rank_stops_the_other_node(root):
    """Two 2-node jobs at once: in one, node 1's worker is SIGKILLed; in the other it is SIGSTOPped (hangs)."""
    timeout = 5
    args = [*BASE, "--max-steps", "500", "--no-export", "--dist-timeout", str(timeout)]
    jobs = {how: two_nodes(args, root, f"rank-{how}") for how in ("dies", "hangs")}
    victims, took = {}, {}
    try:
        for how, (node0, node1) in jobs.items():
            node0.wait_for_step(3)
            victims[how] = node1.worker(1)
        t0 = time.time()
        victims["dies"].send_signal(signal.SIGKILL)
        victims["hangs"].send_signal(signal.SIGSTOP)
        for how, (node0, _) in jobs.items():
            node0.wait(timeout=60)
            took[how] = time.time() - t0
        dead, hung = jobs["dies"][0], jobs["hangs"][0]
        # A death is reported as such, not as a collective timeout (no wall-clock bound: a loaded CI box can be
        # slower than any bound; the message says which path named it).
        assert dead.rc == 2, (took, dead.stderr[-2000:])
        assert "a collective waited more than" not in dead.stderr
        pid = victims["dies"].pid
        assert f"rank 0 lost the other ranks: on node 1, rank 1 (pid {pid}) was killed by SIGKILL" in dead.stderr
        jobs["dies"][1].wait(timeout=60)
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in jobs["dies"][1].stderr
        assert hung.rc == 2 and took["hangs"] >= timeout, (took, hung.stderr[-2000:])  # it waited the whole dist_timeout_s
        assert f"a collective waited more than {timeout} s (dist_timeout_s)" in hung.stderr
    finally:
        for victim in victims.values():
            if victim.is_running():
                victim.kill()
        for node0, node1 in jobs.values():
            for run in (node0, node1):
                run.proc.kill()
                run.wait(timeout=60)


# ---- NaN / Inf guard ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_runs(root) -> dict[str, Run]:
    """Five small runs at once: the NaN guard both ways (SHARDLAB_FAULTS: the LM head returns NaN in step 3),
    the pipeline and zero0 runs whose checkpoints the export tests read, and one run aborted by SIGABRT."""
    runs = {
        "nan-stop": Run([*BASE, "--strategy", "zero2", "--max-steps", "6", "--save-every", "2", "--no-export"], root / "nan-stop",
                        env={"SHARDLAB_FAULTS": "nan_loss@3"}),
        "nan-skip": Run([*BASE, "--max-steps", "12", "--nan-policy", "skip", "--no-export"], root / "nan-skip", env={"SHARDLAB_FAULTS": "nan_loss@3"}),
        "pipeline": Run([*BASE, "--strategy", "pipeline", "--gpus", "2", "--max-steps", "2", "--save-every", "2", "--export"], root / "export-pipeline"),
        "zero0": Run([*BASE, "--strategy", "zero0", "--max-steps", "2", "--save-every", "2", "--export"], root / "export-zero0"),
        "abort": Run([*BASE, "--max-steps", "500", "--no-export"], root / "abort"),
    }  # fmt: skip
    runs["abort"].wait_for_step(2)
    runs["abort"].proc.send_signal(signal.SIGABRT)  # what a C++ std::terminate does to a process
    runs["nan-skip"].wait_for_step(4)
    runs["nan-skip"].proc.send_signal(signal.SIGUSR2)  # checkpoint after the current step, and go on
    for run in runs.values():
        run.wait()
    return runs


def test_a_native_abort_prints_where_python_was(single_runs):
    """faulthandler: a rank killed by SIGABRT/SIGSEGV leaves its Python stack, not just an exit code."""
    run = single_runs["abort"]
    assert run.rc == -signal.SIGABRT, run.stderr[-2000:]
    assert "Fatal Python error: Aborted" in run.stderr and "in run_worker" in run.stderr, run.stderr[-3000:]


def test_nan_stop_names_the_step(single_runs):
    """zero2: DeepSpeed skips the update itself; shardlab stops, naming the step."""
    run = single_runs["nan-stop"]
    assert run.rc == 2 and "Traceback" not in run.stderr
    assert "error: non-finite loss nan at step 3" in run.stderr and "--nan-policy skip" in run.stderr
    assert last_step(run.out) == 3 and latest(run.out) == "step-0000002" and not (run.out / "summary.json").exists()


def test_nan_skip_skips_the_update_and_usr2_checkpoints_on_demand(single_runs):
    run = single_runs["nan-skip"].ok()
    assert "step 3: non-finite loss nan; update skipped" in run.stdout_path.read_text()
    got = losses(run.out)
    assert math.isnan(got[3]) and all(math.isfinite(got[s]) for s in range(1, 13) if s != 3)
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["overflow_steps"] == 0 and summary["steps"] == 12
    assert [r.get("skipped_steps") for r in rows(run.out) if "loss" in r] == [None, None] + [1] * 10
    saved = [p.name for p in (run.out / "checkpoints").iterdir() if p.is_dir()]
    assert len(saved) == 1 and 4 < int(saved[0].removeprefix("step-")) <= 12, saved  # no --save-every: only the asked-for one


# ---- elastic resume: zero2 on 2 ranks -> zero3 on 1 -> fsdp on 2 -> dp on 1 --------------------------------------

CHAIN = [("zero2", 2, 4), ("zero3", 1, 8), ("fsdp", 2, 12), ("dp", 1, 16)]


@pytest.fixture(scope="module")
def ref0_run(root) -> Run:
    return Run([*ELASTIC, "--gpus", "1", "--max-steps", "16", "--no-export"], root / "ref0")  # one process: micro 2 x accum 2


@pytest.fixture(scope="module")
def ref0(ref0_run) -> Path:
    return ref0_run.ok().out


@pytest.fixture(scope="module")
def elastic(root, ref0_run) -> Path:
    out = root / "elastic"
    for strategy, gpus, steps in CHAIN:
        export = ["--export"] if steps == 16 else ["--no-export"]
        resume = ["--resume", "auto"] if steps > 4 else []
        Run([*ELASTIC, "--strategy", strategy, "--gpus", str(gpus), "--max-steps", str(steps), *resume, *export], out, tag=f"-{strategy}").ok()
    return out


def test_elastic_resume_continues_the_losses(elastic, ref0):
    assert_same_losses(losses(elastic), losses(ref0), range(1, 17), rel=1e-4)
    for strategy, gpus, steps in CHAIN:
        state = json.loads((elastic / "checkpoints" / f"step-{steps:07d}" / "trainer_state.json").read_text())
        assert state["layout"]["strategy"] == strategy and state["layout"]["world_size"] == gpus and state["layout"]["global_batch"] == 4
    assert (elastic / "checkpoints" / "step-0000004" / "universal" / "zero").is_dir()  # DeepSpeed's universal format, made once
    assert "resumed from" in (elastic.parent / "elastic-fsdp.stdout").read_text()


def test_unsupported_pair_is_refused_before_anything_starts(ref0):
    before = sorted(p.name for p in ref0.rglob("*"))
    proc = run_shardlab(["train", *ELASTIC, "--strategy", "zero3", "--gpus", "2", "--max-steps", "20", "--resume", "auto",
                         "--output-dir", str(ref0)], timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: a dp checkpoint written on 1 rank(s) cannot be resumed as zero3 on 2 rank(s)" in proc.stderr
    assert "supported: dp/fsdp/fsdp_offload/pipeline -> dp/fsdp/fsdp_offload/pipeline" in proc.stderr
    assert sorted(p.name for p in ref0.rglob("*")) == before


# ---- export: every strategy's checkpoint reloads with the eval loss the run measured --------------------------------


@pytest.mark.parametrize("strategy,world,step", [("zero2", 2, 4), ("zero3", 1, 8), ("fsdp", 2, 12), ("dp", 1, 16)])
def test_export_of_every_strategy_reproduces_its_eval_loss(elastic, ref0, tmp_path, trainer_eval_loss, strategy, world, step):
    from transformers import AutoModelForCausalLM

    from shardlab.config import load_config
    from shardlab.data import build_datasets
    from shardlab.checkpoint.export import export_checkpoint
    from shardlab.training.tokenizing import load_tokenizer

    run = ref0 if strategy == "dp" else elastic
    ckpt = run / "checkpoints" / f"step-{step:07d}"
    universal_before = (ckpt / "universal").exists()
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert (ckpt / "universal").exists() == universal_before  # export leaves the checkpoint as it was
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = load_config(ckpt / "config.yaml")
    assert cfg.strategy == strategy
    splits = build_datasets(cfg.dataset, load_tokenizer(cfg), cfg.seq_len, cfg.seed)
    assert trainer_eval_loss(model, splits.eval, world) == pytest.approx(eval_losses(run)[step], rel=1e-5)


def test_export_cli_equals_the_end_of_run_export(elastic, tmp_path):
    from safetensors.torch import load_file

    proc = run_shardlab(["export", str(elastic), str(tmp_path / "cli")], timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"exported {elastic}" in proc.stdout
    assert (tmp_path / "cli" / "tokenizer.json").is_file()
    mine, end = load_file(tmp_path / "cli" / "model.safetensors"), load_file(elastic / "model" / "model.safetensors")
    assert mine.keys() == end.keys() and all((mine[k] == end[k]).all() for k in mine)
    from shardlab.errors import UserError
    from shardlab.checkpoint.export import export_checkpoint

    with pytest.raises(UserError, match="exists and is not empty"):
        export_checkpoint(elastic, tmp_path / "cli")
    with pytest.raises(UserError, match="neither a complete checkpoint nor a run directory"):
        export_checkpoint(tmp_path, tmp_path / "other")


@pytest.mark.parametrize("strategy", ["pipeline", "zero0"])
def test_export_of_pipeline_and_zero0_checkpoints_equals_their_run_export(single_runs, tmp_path, strategy):
    """A DCP checkpoint written by pipeline stages (each under the whole model's names) and DeepSpeed stage 0's module file: the offline
    export of the last checkpoint equals, tensor for tensor, the model the run itself exported at its end."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardlab.checkpoint.export import export_checkpoint

    run = single_runs[strategy].ok()
    mine = AutoModelForCausalLM.from_pretrained(export_checkpoint(run.out, tmp_path / "hf")).state_dict()
    end = AutoModelForCausalLM.from_pretrained(run.out / "model").state_dict()
    assert mine.keys() == end.keys() and all(torch.equal(mine[k], end[k]) for k in mine)


# ---- a real SLURM: sbatch the rendered script, preempt it twice, it requeues and resumes by itself ------------------


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def test_slurm_job_survives_signal_and_requeue(slurm, root, ref):
    out = root / "slurm-run"
    proc = subprocess.run([sys.executable, "-m", "shardlab", "slurm", *RESUME, "--export", "--gpus", "2", "--cpus-per-task", "2",
                           "--output-dir", str(out), "--submit"], capture_output=True, text=True, env=slurm.env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    snapshot = next((out / "slurm").iterdir())
    job = (snapshot / "job_id").read_text().strip()
    assert f"submitted job {job}" in proc.stdout

    def reach(step: int) -> None:
        deadline = time.time() + patience(TIMEOUT)
        while last_step(out) < step or slurm.state(job) != "RUNNING":
            assert time.time() < deadline and slurm.state(job) not in ENDED, slurm.state(job)
            time.sleep(0.1)

    reach(3)
    slurm.run("scancel", "--signal=USR1", job)  # what `--signal=USR1@N` sends before the time limit
    # The ranks see the stop flag at a step's loss all-reduce, so the first run may finish a step or two more:
    # wait for the requeue itself, then for the requeued run to train past the checkpoint.
    deadline = time.time() + patience(TIMEOUT)
    while slurm.restarts(job) < 1:  # (the state passes through requeue transitions meanwhile)
        assert time.time() < deadline, f"job {job} not requeued after SIGUSR1: {slurm.state(job)}"
        time.sleep(0.2)
    reach(last_step(out) + 1)
    assert slurm.restarts(job) == 1
    slurm.run("scontrol", "requeue", job)  # SIGTERM, then requeued by SLURM itself
    assert slurm.wait_state(job, ENDED, TIMEOUT) == "COMPLETED"
    assert slurm.restarts(job) == 2

    log = (snapshot / f"slurm-{job}.out").read_text()
    assert "got SIGUSR1" in log and "got SIGTERM" in log and log.count("requeueing job") >= 1
    assert "restart 2" in log and log.count("resumed from") == 2
    assert_same_losses(losses(out), ref, range(1, 15), rel=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 14 and (out / "model" / "config.json").is_file()
    # the job ran the snapshot taken at submission, not the code on disk
    argv0 = json.loads((out / "env.json").read_text())["argv"][0]
    assert argv0.startswith(str(snapshot / "code" / "shardlab")), argv0
