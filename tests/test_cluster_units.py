"""Cluster pieces that need no training run: hostfiles, SLURM's variables, the sbatch script and its snapshot,
the rules of elastic resume, checkpoint discovery, signal flags, and the optimizer-step guards (fp16 overflow
counting with a real GradScaler, non-finite gradient skipping)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
import torch

from shardlab.config import load_config
from shardlab.errors import UserError

# ---- hostfile and SLURM topology ----------------------------------------------------------------------------------


def hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hostfile_sets_nodes_gpus_master_and_rank(tmp_path):
    from shardlab.launch.nodes import apply_hostfile, read_hostfile

    hf = hostfile(tmp_path, "# two nodes\nlocalhost slots=4\n\nnode-b slots=4  # second\n")
    assert read_hostfile(hf) == [("localhost", 4), ("node-b", 4)]
    cfg = apply_hostfile(load_config(None, {"hostfile": hf}))
    assert (cfg.nodes, cfg.gpus, cfg.master_addr, cfg.node_rank) == (2, 4, "localhost", 0)
    # a machine not in the file keeps the --node-rank it was given
    other = apply_hostfile(load_config(None, {"hostfile": hostfile(tmp_path, "a slots=1\nb slots=1\n"), "nodes": 2, "node_rank": 1}))
    assert (other.nodes, other.node_rank, other.master_addr) == (2, 1, "a")


@pytest.mark.parametrize("text,match", [
    ("node-a slots=2\nnode-b\n", "line 2 is not 'hostname slots=N'"),
    ("node-a slots=zero\n", "line 1 is not"),
    ("# nothing\n", "lists no hosts"),
    ("node-a slots=2\nnode-b slots=4\n", "different slot counts"),
    ("remote slots=1\nlocalhost slots=1\n127.0.0.1 slots=1\n", "appears 2 times"),  # and --node-rank 0 is not one of them
])  # fmt: skip
def test_bad_hostfiles_are_one_line_errors(tmp_path, text, match):
    from shardlab.launch.nodes import apply_hostfile

    with pytest.raises(UserError, match=match):
        apply_hostfile(load_config(None, {"hostfile": hostfile(tmp_path, text)}))
    with pytest.raises(UserError, match="not found"):
        apply_hostfile(load_config(None, {"hostfile": str(tmp_path / "missing")}))


def test_slurm_node_agent_takes_its_place_from_slurm(monkeypatch):
    from shardlab.runtime.distributed import in_launched_job
    from shardlab.launch.nodes import resolve_nodes

    for k, v in {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]",
                 "SLURM_NTASKS": "3", "SLURM_PROCID": "2"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert in_launched_job()  # one task per GPU: srun made this process a rank
    monkeypatch.setenv("SHARDLAB_NODE_AGENT", "slurm")
    assert not in_launched_job()  # one task per node: this process launches the node's workers
    cfg = resolve_nodes(load_config(None, {"gpus": 4}))
    assert (cfg.nodes, cfg.node_rank, cfg.master_addr, cfg.gpus) == (3, 2, "gpu07", 4)


# ---- shardlab slurm --------------------------------------------------------------------------------------------------


def test_slurm_script_and_snapshot(tmp_path):
    from shardlab.launch.slurm import SlurmOptions, prepare

    cfg = load_config(None, {"model": "tiny-gpt2", "device": "cuda", "gpus": 4, "nodes": 2, "strategy": "zero3", "output_dir": str(tmp_path / "run")})
    opts = SlurmOptions(partition="gpu", account="lab", time="04:00:00", mem="64G", cpus_per_task=16, setup=["module load cuda/12.4"],
                        signal_lead_s=120, python="python", sbatch_args=["--qos=short"])  # fmt: skip
    job = prepare(cfg, opts)
    snap = job.snapshot
    assert snap.parent == tmp_path / "run" / "slurm" and not list(snap.parent.glob("*.tmp"))
    assert (snap / "code" / "shardlab" / "loop" / "trainer.py").read_text() == (Path(__import__("shardlab").__file__).parent / "loop" / "trainer.py").read_text()
    assert not list((snap / "code").rglob("__pycache__"))
    ran = load_config(snap / "config.yaml")
    assert ran.resume == "auto" and ran.output_dir == str(tmp_path / "run") and (ran.nodes, ran.gpus, ran.strategy) == (2, 4, "zero3")
    script = job.script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --mem=64G", "#SBATCH --time=04:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --qos=short", "module load cuda/12.4",
                 f"export PYTHONPATH={snap}/code", "export SHARDLAB_NODE_AGENT=slurm", 'scontrol requeue "$SLURM_JOB_ID"',
                 f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m shardlab train --config {snap}/config.yaml --master-port"):  # fmt: skip
        assert line in script, line
    assert script.index("module load") < script.index("srun")
    assert subprocess.run(["bash", "-n", str(job.script)]).returncode == 0
    assert job.command == ["sbatch", "--parsable", str(job.script)]
    assert json.loads((snap / "provenance.json").read_text())["shardlab_source"]


def test_a_slurm_job_leaves_open_what_the_user_left_open(tmp_path):
    """The job runs `shardlab train --config <snapshot>/config.yaml`. A snapshot listing every field read back as if the
    user had given each: a job with only a DeepSpeed JSON (stage 3) then had --strategy dp "given" and was refused at
    start on the compute node; the snapshot holds what was given, and the job takes the strategy from the JSON."""
    from shardlab.launch.slurm import SlurmOptions, prepare
    from shardlab.strategies.deepspeed_json import adopt_user_json

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    cfg = load_config(None, {"model": "tiny-gpt2", "device": "cpu", "gpus": 2, "deepspeed_config": str(ds),
                             "output_dir": str(tmp_path / "run")})
    snap = prepare(cfg, SlurmOptions()).snapshot
    ran = load_config(snap / "config.yaml")
    assert "strategy" not in ran.model_fields_set and ran.strategy_options.model_fields_set == set()
    assert adopt_user_json(ran, "cpu")[0].strategy == "zero3"
    assert (ran.resume, ran.gpus, ran.deepspeed_config) == ("auto", 2, str(ds))


def test_spawned_workers_read_back_what_was_given():
    """launcher.spawn hands every worker the config as a file: it must read back the same values and the same record of
    what was given, nested options included (strategies decide from that record and from None what is theirs)."""
    from shardlab.config import RunConfig, config_from_dict, dump_config

    cfg = load_config(None, {"model": "tiny-gpt2", "strategy": "zero3_offload", "gpus": 2},
                      {"strategy_options.pin_memory": False, "dataset.source": "synthetic"}).model_copy(update={"micro_batch": 3})
    back = config_from_dict(yaml.safe_load(dump_config(cfg, given_only=True)))
    assert back == cfg
    assert back.model_fields_set == cfg.model_fields_set
    assert back.strategy_options.model_fields_set == {"pin_memory"} and back.dataset.model_fields_set == {"source"}
    assert isinstance(back, RunConfig)


@pytest.mark.parametrize("overrides,match", [
    ({"device": "cuda"}, "needs the number of GPUs per node"),
    ({"device": "cpu", "resume": "/some/ckpt"}, "always resumes with --resume auto"),
    ({"device": "cpu", "gpus": 3, "global_batch": 4}, "not divisible"),
    ({"device": "cpu", "model": "gpt5-nano"}, "gpt5-nano"),
])  # fmt: skip
def test_slurm_refuses_bad_jobs_before_writing(tmp_path, overrides, match):
    from shardlab.launch.slurm import SlurmOptions, prepare

    with pytest.raises(UserError, match=match):
        prepare(load_config(None, {"output_dir": str(tmp_path / "run"), **overrides}), SlurmOptions())
    assert not (tmp_path / "run").exists()


def test_slurm_cli_prints_the_command_and_submit_needs_sbatch(tmp_path, capsys, monkeypatch):
    from shardlab.cli import main

    args = ["slurm", "--model", "tiny-gpt2", "--device", "cpu", "--gpus", "2", "--output-dir", str(tmp_path / "run")]
    assert main(args) == 0
    out = capsys.readouterr().out
    script = next((tmp_path / "run" / "slurm").glob("*/job.sbatch"))
    assert f"sbatch --parsable {script}" in out and "--gpus-per-node" not in script.read_text()  # CPU workers: no GPU request
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert main([*args, "--submit"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err


# ---- elastic resume rules, checkpoint discovery ---------------------------------------------------------------------


def layout(strategy: str, world: int, glob: int = 8, weight_decay: float = 0.0) -> dict:
    return {"strategy": strategy, "world_size": world, "dp_size": world, "micro_batch": 1, "grad_accum": glob // world, "global_batch": glob,
            "pp_stages": None, "weight_decay": weight_decay}  # fmt: skip


@pytest.mark.parametrize("src,dst,ok", [
    (("zero2", 2), ("zero3", 1), True), (("zero3", 4), ("zero1_offload", 2), True), (("zero2", 2), ("fsdp", 4), True),
    (("zero3", 2), ("dp", 1), True), (("dp", 2), ("fsdp", 1), True), (("fsdp", 4), ("dp", 2), True), (("zero2", 2), ("zero2", 2), True),
    (("pipeline", 2), ("pipeline", 2), True), (("zero0", 2), ("zero0", 2), True), (("pipeline", 2), ("dp", 2), True),
    (("pipeline", 4), ("fsdp", 1), True), (("dp", 1), ("pipeline", 2), True), (("fsdp", 2), ("pipeline", 4), True),
    (("dp", 2), ("zero2", 2), False), (("fsdp", 2), ("zero3", 2), False), (("zero0", 2), ("zero0", 1), False),
    (("zero2", 2), ("zero0", 2), False), (("pipeline", 2), ("zero2", 2), False), (("zero2", 2), ("pipeline", 2), False),
    (("infinity", 1), ("zero3", 1), False),
])  # fmt: skip
def test_elastic_pairs(src, dst, ok):
    from shardlab.checkpoint.reshard import check_pair

    if ok:
        check_pair(layout(*src), layout(*dst))
    else:
        with pytest.raises(UserError, match=rf"a {src[0]} checkpoint written on {src[1]} rank\(s\) cannot be resumed as {dst[0]}"):
            check_pair(layout(*src), layout(*dst))


def test_elastic_resume_needs_the_same_global_batch():
    from shardlab.checkpoint.reshard import check_pair

    with pytest.raises(UserError, match="global batch 8, this run uses 16"):
        check_pair(layout("dp", 2, 8), layout("dp", 2, 16))


def test_resume_keeps_the_weight_decay():
    from shardlab.checkpoint.reshard import check_pair

    check_pair(layout("zero2", 2, weight_decay=0.1), layout("fsdp", 1, weight_decay=0.1))
    with pytest.raises(UserError, match="weight decay 0.1, this run uses 0.0"):
        check_pair(layout("zero2", 2, weight_decay=0.1), layout("zero2", 2))
    older = {k: v for k, v in layout("dp", 2).items() if k != "weight_decay"}  # before decay 0 became one group
    with pytest.raises(UserError, match="older shardlab, whose optimizer state has two parameter groups"):
        check_pair(older, layout("dp", 2))
    check_pair(older, layout("dp", 2, weight_decay=0.1))  # two groups then and now


def test_resume_auto_picks_the_newest_complete_checkpoint(tmp_path):
    from shardlab.checkpoint.store import find_resume_dir

    root = tmp_path / "checkpoints"
    for name, complete in (("step-0000002", True), ("step-0000004", True), ("step-0000006.tmp", True), ("step-0000008", False)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "trainer_state.json").write_text("{}")
    (root / "latest").write_text("step-0000002")  # stale pointer (a crash between the rename and its update)
    assert find_resume_dir("auto", tmp_path) == root / "step-0000004"
    assert find_resume_dir("auto", tmp_path / "elsewhere") is None
    with pytest.raises(UserError, match="not a complete shardlab checkpoint"):
        find_resume_dir(str(root / "step-0000008"), tmp_path)
    # a run directory (what users pass first, e.g. another run's output_dir): its newest complete checkpoint
    assert find_resume_dir(str(tmp_path), tmp_path / "new-run") == root / "step-0000004"
    empty = tmp_path / "no-saves"
    (empty / "checkpoints" / "step-0000002").mkdir(parents=True)  # never completed
    with pytest.raises(UserError, match="holds no complete checkpoint"):
        find_resume_dir(str(empty), tmp_path / "new-run")


# ---- signals and guards -------------------------------------------------------------------------------------------


def test_stop_signals_only_set_flags():
    from shardlab.runtime.preemption import StopSignals

    before = signal.getsignal(signal.SIGUSR1)
    sig = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert sig.stop_signal is None and sig.take_save_request() and not sig.take_save_request()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first's name
        assert sig.stop_signal == signal.SIGUSR1 and sig.describe() == "SIGUSR1"
    finally:
        sig.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def strategy(precision: str, **cfg):
    from shardlab.runtime.distributed import DistEnv
    from shardlab.runtime.resolved import Precision
    from shardlab.strategies.ddp import DDPStrategy

    torch.manual_seed(0)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    st = DDPStrategy(load_config(None, {"device": "cpu", "lr": 0.1, **cfg}), env, Precision(precision), 1, 4)
    st.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), total_steps=10)
    return st


def step(st, scale: float) -> float | None:
    loss = st.hf_model(torch.ones(2, 4)).sum() * scale
    st.backward(loss, True)
    return st.optimizer_step()


def test_fp16_overflow_steps_are_counted_and_skipped():
    st = strategy("fp16")  # torch's GradScaler, on the CPU, as on a GPU
    before = [p.detach().clone() for p in st.hf_model.parameters()]
    step(st, float("inf"))
    assert st.last_step_skipped and st.overflow_steps == 1 and st.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, st.hf_model.parameters()))
    assert st.scheduler.last_epoch == 0  # the schedule does not advance on a skipped step
    step(st, 1.0)
    assert not st.last_step_skipped and st.overflow_steps == 1 and st.scheduler.last_epoch == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, st.hf_model.parameters()))


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_nonfinite_gradients_never_reach_the_weights(max_grad_norm):
    st = strategy("fp32", nan_policy="skip", max_grad_norm=max_grad_norm)
    before = [p.detach().clone() for p in st.hf_model.parameters()]
    norm = step(st, float("nan"))
    assert norm is not None and norm != norm  # NaN, reported
    assert st.last_step_skipped and st.skipped_steps == 1 and st.overflow_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, st.hf_model.parameters()))
    assert all(p.grad is None for p in st.hf_model.parameters())
    step(st, 1.0)
    assert not st.last_step_skipped and all(torch.isfinite(p).all() for p in st.hf_model.parameters())


def test_fault_spec_parsing(monkeypatch):
    from shardlab.runtime import faults

    monkeypatch.setenv(faults.ENV, "kill_in_save@8:1, nan_loss@3")
    assert faults._wanted("kill_in_save", 8, 1) and not faults._wanted("kill_in_save", 8, 0) and not faults._wanted("kill_in_save", 7, 1)
    assert faults._wanted("nan_loss", 3, 0) and faults._wanted("nan_loss", 3, 5) and not faults._wanted("nan_loss", 4, 0)
    monkeypatch.setenv(faults.ENV, "kill@6:1")
    assert faults._wanted("kill", 6, 1) and not faults._wanted("kill", 6, 0) and not faults._wanted("kill_in_save", 6, 1)


def test_kill_fault_fires_in_the_first_training_forward_of_its_step(monkeypatch):
    from shardlab.runtime import faults

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(2, 2)

        def get_output_embeddings(self):
            return self.head

    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setenv(faults.ENV, "kill@3:1")
    survivor, victim = Tiny(), Tiny()
    faults.arm(survivor, 0, 1, 2)  # resumed after step 1, 2 micro-batches per step
    faults.arm(victim, 1, 1, 2)
    x = torch.zeros(1, 2)
    for _ in range(2):  # step 2
        survivor.head(x), victim.head(x)
    victim.eval()
    victim.head(x)  # an eval forward counts for no step
    assert sent == []
    victim.train()
    survivor.head(x), victim.head(x)  # step 3, first micro-batch
    assert sent == [(os.getpid(), signal.SIGKILL)]


def _failure(rank: int, exitcode: int, timestamp: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")
    failure.timestamp = timestamp  # the launcher's poll time, in whole seconds
    return failure


def test_the_killed_rank_is_named_not_the_survivor_when_both_die_in_one_second():
    from shardlab.launch.failures import WorkerFailed
    from shardlab.runtime.preemption import REQUEUE_EXIT

    # rank 0 lost its peer and exited with its one-line error; rank 1 was SIGKILLed; one poll saw both
    for failures in ({0: _failure(0, 2, 100), 1: _failure(1, -signal.SIGKILL, 100)},
                     {1: _failure(1, -signal.SIGKILL, 100), 0: _failure(0, 2, 100)}):  # fmt: skip
        err = WorkerFailed.from_failures(failures)
        assert "rank 1 (pid 1001) was killed by SIGKILL" in str(err) and err.exitcode == 128 + signal.SIGKILL
    # the launcher's SIGTERM to a rank still running, and a survivor's abort while tearing down, are not the cause
    err = WorkerFailed.from_failures({0: _failure(0, -signal.SIGABRT, 100), 1: _failure(1, -signal.SIGKILL, 100), 2: _failure(2, -signal.SIGTERM, 100)})
    assert "rank 1 (pid 1001)" in str(err)
    err = WorkerFailed.from_failures({0: _failure(0, -signal.SIGTERM, 100), 1: _failure(1, 1, 100)})
    assert err.exitcode == 1 and "(rank 1;" in str(err)
    # an earlier poll still wins: a rank that failed first is the cause whatever a later one died of
    err = WorkerFailed.from_failures({0: _failure(0, 1, 99), 1: _failure(1, -signal.SIGKILL, 130)})
    assert err.exitcode == 1 and "(rank 0;" in str(err)
    # preemption: every rank checkpointed and stopped (exit 75); one the launcher SIGTERMed on the way is no failure
    err = WorkerFailed.from_failures({0: _failure(0, -signal.SIGTERM, 100), 1: _failure(1, REQUEUE_EXIT, 100)})
    assert err.exitcode == REQUEUE_EXIT
    err = WorkerFailed.from_failures({0: _failure(0, REQUEUE_EXIT, 100), 1: _failure(1, 1, 100)})
    assert err.exitcode == 1


def test_a_group_broken_by_a_dead_peer_is_not_torn_down(monkeypatch):
    """Destroying it can std::terminate (SIGABRT) a survivor that already printed its error; exit_process flushes and
    leaves with os._exit, skipping the interpreter's teardown."""
    from shardlab.runtime import distributed

    monkeypatch.setattr(distributed, "_group_broken", False)  # restored after the test
    destroyed, exited = [], []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: destroyed.append(True))
    monkeypatch.setattr(distributed.os, "_exit", exited.append)
    distributed.shutdown_distributed()
    assert destroyed == [True]
    with pytest.raises(SystemExit):
        distributed.exit_process(2)
    distributed.mark_group_broken()
    distributed.shutdown_distributed()
    with pytest.raises(SystemExit):  # only because os._exit is a stand-in here that returns
        distributed.exit_process(2)
    assert destroyed == [True] and exited == [2]


class _RunsCode:
    """Unpickling this calls os.mkdir: what a checkpoint file from elsewhere could do with weights_only=False."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_export_refuses_a_zero_checkpoint_whose_files_would_run_code(tmp_path):
    """DeepSpeed's zero_to_fp32 unpickles with weights_only=False: export screens a checkpoint shardlab did not write
    for this user first (checkpoint/trust.py), every file weights-only."""
    from shardlab.checkpoint import export, reshard, store

    source = tmp_path / "ckpt" / reshard.DS_TAG
    source.mkdir(parents=True)
    (tmp_path / "ckpt" / store.TRAINER_STATE).write_text(json.dumps({"global_step": 1, "layout": {"strategy": "zero2"}}))
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": _RunsCode(str(marker))}, source / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UserError, match="mkdir") as err:
        export.export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert not marker.exists() and "\n" not in err.value.message and "--trust-checkpoint" in err.value.hint
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="holds no DeepSpeed ZeRO checkpoint"):
        export._zero_weights(tmp_path)
