"""runtime/pin.py: which runs pin their training thread, and that what the pinned thread starts later (threads, forked,
spawned and exec'd processes) gets the full CPU set back; and the one-rank ZeRO-3 defaults that go with it
(block leaves, contiguous_gradients off) in the generated DeepSpeed JSON. GPU figures:
benchmarks/results/2026-11-27-h100-zero3-pin/."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.util
import os
import subprocess
import sys
import threading

import pytest
from torch import nn

from shardlab.config import RunConfig
from shardlab.runtime import pin
from shardlab.strategies.deepspeed_config import build_ds_config, resolved_ds_config, zero3_leaf_classes

CORES = sorted(os.sched_getaffinity(0))
needs_2_cpus = pytest.mark.skipif(len(CORES) < 2, reason="pinning to one CPU changes nothing on one")


# ---- scope -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, device, extra, pinned", [
    ("dp", "cuda", {}, True), ("zero3", "cuda", {}, True), ("zero1", "cuda", {}, True), ("zero2", "cuda", {}, True),
    ("fsdp", "cuda", {}, True), ("zero0", "cuda", {}, False),  # zero0: not measured pinned
    ("dp", "cpu", {}, False),  # a CPU run computes on the cores
    ("zero3_offload", "cuda", {}, False), ("zero2_offload", "cuda", {}, False), ("infinity", "cuda", {}, False),
    ("fsdp_offload", "cuda", {}, False), ("ao_offload", "cuda", {}, False),  # CPU optimizers / offload: never
    ("ao_offload", "cuda", {"pin_thread": "on"}, False),
    ("dp", "cuda", {"compile": True}, False),  # auto: compiled runs not measured
    ("dp", "cuda", {"compile": True, "pin_thread": "on"}, True),
    ("pipeline", "cuda", {}, False), ("pipeline", "cuda", {"pin_thread": "on"}, True),
    ("zero3", "cuda", {"pin_thread": "off"}, False),
])  # fmt: skip
def test_which_runs_pin(strategy, device, extra, pinned):
    cpu, why = pin.pin_decision(RunConfig(strategy=strategy, **extra), device, 0, 1, cores=[4, 5, 6, 7])
    assert (cpu is not None) == pinned, why
    if pinned:
        assert cpu == 7  # the last CPU of the rank's share


def test_each_rank_pins_inside_its_own_share():
    cfg = RunConfig(strategy="zero3")
    cpus = [pin.pin_decision(cfg, "cuda", r, 4, cores=list(range(16)))[0] for r in range(4)]
    assert cpus == [3, 7, 11, 15]  # rank r: the last of CPUs 4r..4r+3
    cpu, why = pin.pin_decision(cfg, "cuda", 0, 8, cores=[0, 1])
    assert cpu is None and "no CPU of its own" in why


def test_ranks_share_whole_physical_cores_and_pin_on_different_ones(monkeypatch):
    """A 16-core host with SMT, as Linux numbers it: CPU n and n + 16 are one core. Halving the logical list gave rank
    0 CPUs 0-15 and rank 1 CPUs 16-31 (the two threads of every core) and pinned both training threads to core 15."""
    from shardlab.runtime import distributed

    monkeypatch.setattr(distributed, "core_siblings", lambda cpu: (cpu % 16, cpu % 16 + 16))
    cores = list(range(32))
    shares = [distributed.rank_share(cores, r, 2) for r in range(2)]
    assert shares == [[*range(0, 8), *range(16, 24)], [*range(8, 16), *range(24, 32)]]
    cfg = RunConfig(strategy="fsdp")
    pinned = [pin.pin_decision(cfg, "cuda", r, 2, cores=cores)[0] for r in range(2)]
    assert pinned == [23, 31] and pinned[0] % 16 != pinned[1] % 16  # cores 7 and 15
    # fewer physical cores than ranks: each rank still gets a CPU of its own
    assert [distributed.rank_share([0, 16], r, 2) for r in range(2)] == [[0], [16]]


def test_cpu_lists_and_the_recorded_topology():
    from shardlab.loop.reporting import cpu_topology
    from shardlab.runtime.distributed import parse_cpu_list

    assert parse_cpu_list("0-3,16,18-19\n") == [0, 1, 2, 3, 16, 18, 19]
    topo = cpu_topology()
    assert topo["logical"] == len(os.sched_getaffinity(0)) and 1 <= topo["physical"] <= topo["logical"]


def test_pin_thread_is_a_flag():
    from shardlab.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["train", "--pin-thread", "off"])).pin_thread == "off"
    assert RunConfig().pin_thread == "auto"


# ---- what the pinned thread starts keeps the full set ---------------------------------------------------


def _mask_in_thread() -> set[int]:
    out = []
    t = threading.Thread(target=lambda: out.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    return out[0]


def _report_mask(q):
    q.put(sorted(os.sched_getaffinity(0)))


@needs_2_cpus
def test_pin_confines_the_thread_and_not_what_it_starts():
    """One test (each pin is process-wide state): pinned, the calling thread and an existing thread passed in are on
    one CPU; a Python thread, a forked and a spawned multiprocessing child, a subprocess and an os.posix_spawn'd
    process started from the pinned thread all see the full set; release gives the full set back."""
    full = set(os.sched_getaffinity(0))
    creators = (threading.Thread.start, subprocess.Popen._execute_child, os.posix_spawn)
    ready, stop, seen = threading.Event(), threading.Event(), {}

    def helper():  # stands in for autograd's device thread, created before the pin
        seen["tid"] = threading.get_native_id()
        ready.set()
        stop.wait()
        seen["mask"] = os.sched_getaffinity(0)

    h = threading.Thread(target=helper)
    h.start()
    ready.wait()
    cpu = CORES[-1]
    try:
        info = pin.pin(cpu, threads=[seen["tid"]])
        assert info == {"cpu": cpu, "threads": 2, "full_set": len(full)} and pin.is_pinned()
        assert os.sched_getaffinity(0) == {cpu} and os.sched_getaffinity(seen["tid"]) == {cpu}
        assert _mask_in_thread() == full
        q = multiprocessing.get_context("fork").Queue()
        p = multiprocessing.get_context("fork").Process(target=_report_mask, args=(q,))
        p.start()
        assert set(q.get(timeout=60)) == full
        p.join()
        cmd = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        assert set(json.loads(subprocess.check_output(cmd))) == full
        # multiprocessing's spawn and forkserver start their interpreter with util.spawnv_passfds (no at-fork hooks run)
        r, w = os.pipe()
        script = f"import os; os.write({w}, str(sorted(os.sched_getaffinity(0))).encode())"
        pid = multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable), [sys.executable, "-c", script], [w])
        os.close(w)
        os.waitpid(pid, 0)
        assert set(json.loads(os.read(r, 4096))) == full
        os.close(r)
        r, w = os.pipe()
        pid = os.posix_spawn(sys.executable, cmd, os.environ, file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)])
        os.close(w)
        os.waitpid(pid, 0)
        assert set(json.loads(os.read(r, 4096))) == full
        os.close(r)
        assert os.sched_getaffinity(0) == {cpu}  # narrowed again after each creation
    finally:
        pin.release()
        stop.set()
        h.join()
    assert not pin.is_pinned() and os.sched_getaffinity(0) == full and seen["mask"] == full
    # the wrappers around CPython's creators are gone with the pin (compat/thread_spawn.py)
    assert (threading.Thread.start, subprocess.Popen._execute_child, os.posix_spawn) == creators


# ---- one-rank ZeRO-3 defaults in the generated JSON -------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.h = nn.ModuleList([Block(), Block()])


def test_leaf_class_is_the_decoder_block():
    assert zero3_leaf_classes(Model()) == ["Block"]
    assert zero3_leaf_classes(nn.Linear(2, 2)) == [] and zero3_leaf_classes(None) == []


@pytest.mark.parametrize("strategy, world, no_contiguous, leaves", [
    ("zero3", 1, True, True), ("zero3", 2, True, True), ("zero3_offload", 1, False, False), ("infinity", 1, False, False),
    ("zero3_offload", 2, False, False), ("zero2", 1, False, False), ("zero1", 1, False, False),
])  # fmt: skip
def test_zero3_without_offload_gets_block_leaves_and_no_contiguous_gradients(strategy, world, no_contiguous, leaves, tmp_path):
    cfg = RunConfig(strategy=strategy, strategy_options={"nvme_path": str(tmp_path)})
    zero = build_ds_config(cfg, "bf16", 8, 1, world, "cuda", 1000, 4, ["GPT2Block"])["zero_optimization"]
    assert zero["contiguous_gradients"] is (not no_contiguous)
    assert ("leaf_module" in zero) == leaves
    if leaves:
        assert zero["leaf_module"]["classes"][-1] == "GPT2Block"  # after DeepSpeed's own default (MoE) leaves


@pytest.mark.parametrize("strategy, given, leaves", [("zero3", False, False), ("zero3_offload", True, True)])
def test_block_leaves_follow_the_option(strategy, given, leaves):
    cfg = RunConfig(strategy=strategy, strategy_options={"zero3_block_leaves": given})
    zero = build_ds_config(cfg, "bf16", 8, 1, 2, "cuda", 1000, 4, ["GPT2Block"])["zero_optimization"]
    assert ("leaf_module" in zero) == leaves


def test_a_users_choices_win(tmp_path):
    cfg = RunConfig(strategy="zero3", strategy_options={"contiguous_gradients": True})
    assert build_ds_config(cfg, "bf16", 8, 1, 1, "cuda", 1000, 4, ["GPT2Block"])["zero_optimization"]["contiguous_gradients"]
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"leaf_module": {"classes": []}, "contiguous_gradients": True,
                                                      "stage3_module_granularity_threshold": 1500000}}))
    zero = resolved_ds_config(RunConfig(strategy="zero3", deepspeed_config=str(user)), "bf16", 8, 1, 1, "cuda",
                              None, 1000, 4, ["GPT2Block"])["zero_optimization"]
    assert zero["leaf_module"] == {"classes": []} and zero["contiguous_gradients"] is True
    assert zero["stage3_module_granularity_threshold"] == 1500000


@pytest.mark.parametrize("model, block", [("tiny-gpt2", "GPT2Block"), ("tiny-bloom", "BloomBlock"), ("tiny-llama", "LlamaDecoderLayer")])
def test_dry_run_shows_the_leaves_the_engine_gets(model, block, tmp_path, capsys, monkeypatch):
    """`train --dry-run` prints the DeepSpeed JSON with the block class counted on the meta device (planner.Arch), the
    class the engine gets from the built model, on one rank and on several; not with offload."""
    from shardlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", model, "--strategy", "zero3", "--device", "cpu", "--dry-run"]) == 0
    zero = json.loads(capsys.readouterr().out.split("# DeepSpeed config\n")[1])["zero_optimization"]
    assert zero["leaf_module"]["classes"][-1] == block
    assert main(["train", "--model", model, "--strategy", "zero3", "--device", "cpu", "--gpus", "2", "--dry-run"]) == 0
    zero = json.loads(capsys.readouterr().out.split("# DeepSpeed config\n")[1])["zero_optimization"]
    assert zero["leaf_module"]["classes"][-1] == block
    assert main(["train", "--model", model, "--strategy", "zero3_offload", "--device", "cpu", "--gpus", "2", "--dry-run"]) == 0
    assert "leaf_module" not in json.loads(capsys.readouterr().out.split("# DeepSpeed config\n")[1])["zero_optimization"]
