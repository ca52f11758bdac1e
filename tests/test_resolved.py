"""A run is resolved once (shardlab.runtime.resolved): the launching process decides device, precision, processes, layout and
batch; the ranks it spawns run what it decided (the record beside their config) instead of deciding again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardlab.config import RunConfig, dump_config
from shardlab.errors import UserError
from shardlab.layout import ParallelLayout
from shardlab.runtime.resolved import ResolvedRun, resolve_run
from shardlab.runtime.distributed import free_port


def cpu(**kw) -> RunConfig:
    return RunConfig(model="tiny-gpt2", device="cpu", seq_len=32, **kw)


def test_the_resolved_run_holds_every_decision_and_survives_its_record():
    run = resolve_run(cpu(strategy="pipeline", gpus=4, micro_batch=2, global_batch=16,
                          strategy_options={"pp_stages": 2}), layers=2)
    assert (run.device_type, run.precision.name, run.nproc, run.world) == ("cpu", "fp32", 4, 4)
    assert (run.layout.stages, run.dp_size, run.layout.microbatches) == (2, 2, 4)
    assert (run.micro, run.accum, run.global_batch) == (2, 4, 16)  # the two pipelines share the global batch
    assert run.spec.engine == "pipelining"
    back = ResolvedRun.from_record(run.cfg, json.loads(json.dumps(run.record())))
    assert back == run


def test_what_cannot_run_is_refused_while_resolving():
    with pytest.raises(UserError, match="fp16 training is not supported on CPU"):
        resolve_run(cpu(precision="fp16"))
    with pytest.raises(UserError, match="pipeline stages but tiny-gpt2 has only 2 layers"):
        resolve_run(cpu(strategy="pipeline", gpus=4, micro_batch=2, strategy_options={"pp_stages": 4}), layers=2)
    # a batch refusal is reworded by the caller's explain (the launcher's: sizes a DeepSpeed JSON set, said as the JSON's)
    with pytest.raises(UserError, match="JSON says so"):
        resolve_run(cpu(gpus=2, micro_batch=3, global_batch=4),
                    explain=lambda cfg, err: UserError(f"{err.message}; the JSON says so", err.hint))


def test_micro_batch_auto_leaves_the_batch_open_until_the_search_settles_it():
    run = resolve_run(cpu(gpus=2, micro_batch="auto"))
    assert (run.micro, run.accum, run.global_batch) == (None, None, None)
    settled = run.with_config(run.cfg.model_copy(update={"micro_batch": 8}))
    assert (settled.micro, settled.accum, settled.global_batch, settled.world) == (8, 1, 16, 2)
    assert settled.device_type == run.device_type and settled.precision == run.precision


@pytest.mark.slow
def test_a_spawned_rank_runs_the_launchers_decisions_not_its_own(tmp_path):
    # The record says micro 1 x accumulation 2 where the config alone resolves to micro 2 x 1: a rank that resolved
    # the config again would train 2 x 1.
    cfg = cpu(dataset={"source": "synthetic", "synthetic_tokens": 4000, "eval_split": 0.0}, micro_batch=2, max_steps=2,
              export=False, eval_at_start=False, output_dir=str(tmp_path / "run"))
    own = resolve_run(cfg)
    assert (own.micro, own.accum) == (2, 1)
    record = {**own.record(), "micro": 1, "accum": 2, "layout": {**own.record()["layout"], "microbatches": 2}}
    (tmp_path / "config.yaml").write_text(dump_config(cfg, given_only=True))
    (tmp_path / "resolved.json").write_text(json.dumps(record))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "shardlab.launch.worker", str(tmp_path / "config.yaml"),
                           str(tmp_path / "resolved.json")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["micro_batch"], summary["grad_accum"]) == (1, 2)
    assert ParallelLayout(**record["layout"]).microbatches == 2
