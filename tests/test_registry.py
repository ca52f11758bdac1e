"""The strategy registry (specs/registry.py): every name has a spec and a class, the facts moved into the specs
are the ones main had, nothing outside strategies/ and specs/ compares strategy names, and a new spec needs no other
edit."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from shardlab.specs import registry

SRC = Path(__file__).resolve().parents[1] / "src" / "shardlab"

# Regression oracles, copied from main before the registry existed (config.STRATEGIES, planner.SPEED_ORDER and
# MEASURED_SPEED, trainer.NEXT with its default "zero3", deepspeed_config.STAGE).
MAIN_STRATEGIES = ("dp", "zero0", "zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload",
                   "infinity", "fsdp", "fsdp_offload", "ao_offload", "pipeline")
MAIN_SPEED_ORDER = ("dp", "zero0", "zero1", "zero2", "fsdp", "zero3", "zero2_offload", "ao_offload", "zero1_offload",
                    "fsdp_offload", "zero3_offload", "infinity")
# ao_offload and fsdp_offload: bloom-7b1 side by side on one H100 (benchmarks/results/2026-11-27-h100-big-model)
MAIN_MEASURED_SPEED = {"dp", "zero2", "fsdp", "zero3", "zero2_offload", "ao_offload", "fsdp_offload"}
MAIN_NEXT = {"dp": "zero2", "zero0": "zero2", "zero1": "zero2", "zero2": "zero3", "zero3": "zero3_offload",
             "fsdp": "fsdp_offload", "zero1_offload": "zero2_offload", "zero2_offload": "zero3_offload",
             "zero3_offload": "infinity", "fsdp_offload": "zero3_offload", "infinity": "more GPUs"}
MAIN_STAGE = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero1_offload": 1, "zero2_offload": 2, "zero3_offload": 3,
              "infinity": 3}

NAME_RE = re.compile(r'"(dp|zero[0-3]?|zero[23]_offload|zero1_offload|infinity|fsdp|fsdp_offload|ao_offload|pipeline)"'
                     r'|startswith\("(zero|fsdp)')
# Literals the pattern matches that are not strategy names: (file, text on the line), each with its reason.
NOT_STRATEGY_NAMES = {
    ("cli/__init__.py", '"pipeline": cmd_pipeline'),  # the `shardlab pipeline` subcommand
    ("pipesim/cli.py", 'add_parser("pipeline"'),  # the same subcommand's parser
    ("checkpoint/reshard.py", '/ "zero"'),  # DeepSpeed's universal-checkpoint folder
    ("compat/universal_checkpoint.py", '/ "zero"'),  # the same folder, rewritten there
    ("loop/reporting.py", 'summary.get("pipeline")'),  # summary.json's pipeline section
}


def test_names_keep_mains_order():
    from shardlab.config import STRATEGIES

    assert registry.names() == STRATEGIES == MAIN_STRATEGIES


@pytest.mark.parametrize("name", MAIN_STRATEGIES)
def test_every_name_has_a_spec_and_a_loadable_class(name):
    pytest.importorskip("torch")
    s = registry.spec(name)
    assert s.name == name and s.help and s.engine in ("ddp", "deepspeed", "fsdp2", "torchao", "pipelining")
    if s.engine == "deepspeed":
        pytest.importorskip("deepspeed")
    if s.engine == "torchao":
        pytest.importorskip("torchao")
    from shardlab.strategies import strategy_class
    from shardlab.strategies.base import Strategy

    assert issubclass(strategy_class(name), Strategy)


def test_speed_order_and_oom_suggestions_are_mains():
    from shardlab.planning.planner import MEASURED_SPEED, SPEED_ORDER
    from shardlab.loop.trainer import next_strategy

    assert registry.speed_order() == SPEED_ORDER == MAIN_SPEED_ORDER
    assert MEASURED_SPEED == MAIN_MEASURED_SPEED
    for name in MAIN_STRATEGIES:
        assert next_strategy(name) == MAIN_NEXT.get(name, "zero3"), name
    assert next_strategy("no-such-strategy") == "zero3"


def test_on_several_gpus_the_measured_order_leads_and_the_recommendation_says_where_it_was_measured():
    """Two H200s (benchmarks/results/2026-11-29-h200x2-scaling-bars): the sharded-optimizer strategies before dp, whose
    step is the one-GPU step plus its all-reduce; the rest keep their one-GPU order after those measured there."""
    from shardlab.config import RunConfig
    from shardlab.planning.planner import plan

    several = registry.speed_order(2)
    assert several[:6] == ("zero2", "zero1", "fsdp", "zero3", "dp", "zero0")
    rest = [s for s in MAIN_SPEED_ORDER if s not in several[:6]]
    assert list(several[6:]) == rest
    assert registry.speed_measured("zero2", 2) and not registry.speed_measured("zero0", 2)
    assert not registry.speed_measured("zero2_offload", 2) and registry.speed_measured("zero2_offload", 1)
    cfg = RunConfig(model="tiny-llama", seq_len=512, micro_batch=1, precision="bf16", gpus=2)
    p = plan(cfg, gpu_memory_gb=80, host_ram_gb=250)
    assert p.recommendation == "zero2" and "two H200s" in p.reason and "; measured" in p.reason
    one = plan(cfg.model_copy(update={"gpus": 1}), gpu_memory_gb=80, host_ram_gb=250)
    assert one.recommendation == "dp" and "one H100" in one.reason


def test_stage_has_one_owner():
    pytest.importorskip("deepspeed")
    from shardlab.strategies.deepspeed_config import STAGE

    assert STAGE == MAIN_STAGE == {s.name: s.zero_stage for s in registry.all_specs() if s.zero_stage is not None}


def test_unknown_name_is_a_one_line_user_error():
    from shardlab.errors import UserError

    with pytest.raises(UserError, match="unknown strategy 'zero4'") as err:
        registry.spec("zero4")
    assert "\n" not in str(err.value) and "dp, zero0" in str(err.value)


def test_no_strategy_name_comparisons_outside_strategies():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(("strategies/", "specs/")):
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_RE.search(line) and not any(rel == f and text in line for f, text in NOT_STRATEGY_NAMES):
                found.append(f"{rel}:{no}: {line.strip()}")
    assert not found, "read the strategy's spec instead of its name:\n" + "\n".join(found)


@pytest.fixture
def fake_strategy():
    """A strategy registered at runtime, as a new spec module would: a zero2 twin under a new name."""
    fake = replace(registry.spec("zero2"), name="zero2_twin", order=99, speed_rank=None, help="test only")
    registry.register(fake)
    yield fake
    registry.unregister(fake.name)


def test_a_registered_spec_is_picked_up_without_other_edits(fake_strategy):
    from shardlab.config import RunConfig
    from shardlab.planning.planner import plan

    assert RunConfig(strategy="zero2_twin").strategy == "zero2_twin"  # config validation reads the registry
    assert registry.names()[-1] == "zero2_twin"
    p = plan(RunConfig(model="tiny-gpt2", gpus=2), gpu_memory_gb=80)
    assert "zero2_twin" in p.strategies  # the planner's list too, modelled from the spec's fields
    twin, zero2 = p.strategies["zero2_twin"], p.strategies["zero2"]
    assert (twin.gpu_peak, twin.cpu_per_node) == (zero2.gpu_peak, zero2.cpu_per_node)


def test_unregistered_spec_is_gone(fake_strategy):
    registry.unregister(fake_strategy.name)
    from shardlab.config import RunConfig

    with pytest.raises(ValueError, match="unknown strategy"):
        RunConfig(strategy="zero2_twin")
