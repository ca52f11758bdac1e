"""RunConfig and what is derived from it: batch triple, YAML/flags, DeepSpeed JSON, lr schedule, param groups."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardlab.cli import build_parser, config_from_args, main
from shardlab.config import STRATEGIES, RunConfig, config_from_dict, dump_config, load_config
from shardlab.errors import UserError
from shardlab.training.optim import adamw, lr_lambda, param_groups, scheduler
from shardlab.strategies.deepspeed_config import STAGE, build_ds_config, offload_kind, resolved_ds_config
from shardlab.strategies.deepspeed_json import merge_user_config
from shardlab.strategies.deepspeed_machine import sanitize_cuda_arch_list


def cfg_from_cli(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


# ---- batch triple -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,world,expected",
    [
        (dict(micro_batch=2, grad_accum=3), 2, (2, 3, 12)),  # micro + accum -> global
        (dict(global_batch=32, micro_batch=4), 2, (4, 4, 32)),  # global + micro -> accum
        (dict(global_batch=32, grad_accum=2), 4, (4, 2, 32)),  # global + accum -> micro
        (dict(micro_batch=2, grad_accum=2, global_batch=8), 2, (2, 2, 8)),  # all three, consistent
        (dict(global_batch=32), 4, (8, 1, 32)),  # global alone: all of it per micro batch, no accumulation
        (dict(micro_batch=4), 3, (4, 1, 12)),  # defaults: accumulation 1
        (dict(grad_accum=4), 1, (8, 4, 32)),  # defaults: micro 8
        ({}, 2, (8, 1, 16)),
    ],
)
def test_batch_triple_any_two_determine_the_third(given, world, expected):
    micro, accum, glob = RunConfig(**given).resolve_batch(world)
    assert (micro, accum, glob) == expected
    assert micro * accum * world == glob


@pytest.mark.parametrize(
    "given,world,words",
    [
        (dict(micro_batch=2, grad_accum=2, global_batch=10), 2, ("disagree", "= 8", "global_batch is 10")),
        (dict(global_batch=6), 4, ("global_batch 6", "not divisible", "world size 4")),
        (dict(global_batch=3, micro_batch=1), 2, ("global_batch 3", "world size 2")),
        (dict(global_batch=16, micro_batch=3), 2, ("= 8", "not divisible by micro_batch 3")),
        (dict(global_batch=16, grad_accum=3), 2, ("= 8", "not divisible by grad_accum 3")),
    ],
)
def test_batch_triple_inconsistent(given, world, words):
    with pytest.raises(UserError) as err:
        RunConfig(**given).resolve_batch(world)
    for word in words:
        assert word in str(err.value)
    assert "fix:" in str(err.value)


@pytest.mark.parametrize("key", ["micro_batch", "grad_accum", "global_batch"])
def test_batch_sizes_must_be_positive(key):
    with pytest.raises(UserError, match=key):
        config_from_dict({key: 0})


def test_defaults():
    cfg = RunConfig()
    assert cfg.model == "tiny-gpt2" and cfg.strategy == "dp" and cfg.precision == "auto" and cfg.device == "auto"
    assert cfg.dataset.source == "offline" and cfg.dataset.format == "lm" and cfg.dataset.packing == "pack"
    assert (cfg.micro_batch, cfg.grad_accum, cfg.global_batch) == (None, None, None)
    assert cfg.export is True and cfg.resume is None and cfg.strategy_options.pin_memory is True
    [stage] = cfg.stages()
    assert stage.epochs == 1.0 and stage.max_steps is None and stage.dataset == cfg.dataset
    [stage] = RunConfig(max_steps=7).stages()
    assert stage.max_steps == 7 and stage.epochs is None


def test_every_strategy_name_is_valid_and_others_are_not():
    for name in STRATEGIES:
        assert RunConfig(strategy=name).strategy == name
    with pytest.raises(UserError, match="unknown strategy 'zero4'"):
        config_from_dict({"strategy": "zero4"})


# ---- YAML and flags ----------------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_scientific_notation_is_a_float(tmp_path):
    cfg = load_config(write(tmp_path, "c.yaml", "lr: 5e-5\nweight_decay: 1E-2\nadam_eps: 1e-8\nmin_lr_ratio: 0.1\n"))
    assert isinstance(cfg.lr, float) and cfg.lr == 5e-5
    assert cfg.weight_decay == 0.01 and cfg.adam_eps == 1e-8 and cfg.min_lr_ratio == 0.1


def test_dump_config_round_trips(tmp_path):
    cfg = RunConfig(lr=5e-5, strategy="zero3", micro_batch=2, dataset={"source": "synthetic", "num_samples": 10})
    assert load_config(write(tmp_path, "c.yaml", dump_config(cfg))) == cfg


def test_flags_override_yaml(tmp_path):
    path = write(
        tmp_path,
        "c.yaml",
        "lr: 5e-5\nmicro_batch: 4\nstrategy: zero2\nexport: true\ndataset:\n  source: synthetic\n  num_samples: 10\n",
    )
    cfg = cfg_from_cli("--config", str(path), "--lr", "1e-3", "--strategy", "fsdp", "--num-samples", "5", "--no-export")
    assert cfg.lr == 1e-3 and cfg.strategy == "fsdp" and cfg.export is False  # flags win
    assert cfg.micro_batch == 4 and cfg.dataset.source == "synthetic"  # the rest of the YAML stays
    assert cfg.dataset.num_samples == 5  # a nested key overridden, its siblings kept
    assert cfg_from_cli("--config", str(path)).lr == 5e-5


def test_set_dotted_keys():
    cfg = cfg_from_cli(
        "--set", "strategy_options.pin_memory=false",
        "--set", "strategy_options.reduce_bucket_size=1000",
        "--set", "dataset.eval_samples=3",
        "--set", "lr=5e-5",  # scientific notation reads as a float here too
        "--set", "keep_checkpoints=4",
    )  # fmt: skip
    assert cfg.strategy_options.pin_memory is False and cfg.strategy_options.reduce_bucket_size == 1000
    assert cfg.dataset.eval_samples == 3 and cfg.lr == 5e-5 and cfg.keep_checkpoints == 4
    assert cfg_from_cli("--no-pin-memory").strategy_options.pin_memory is False
    assert cfg_from_cli("--pin-memory").strategy_options.pin_memory is True


def test_set_null_clears_a_key():
    """`--set k=null` is an explicit assignment (clipping off), unlike a flag that was not given."""
    assert RunConfig().max_grad_norm == 1.0
    assert cfg_from_cli("--set", "max_grad_norm=null").max_grad_norm is None
    assert cfg_from_cli("--set", "max_grad_norm=~", "--max-grad-norm", "0.5").max_grad_norm is None  # --set wins
    assert cfg_from_cli("--set", "eval_every=null", "--eval-every", "5").eval_every is None


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--set", "nokey"], ("not KEY=VALUE",)),
        (["--set", "lr=[1"], ("not a valid YAML value",)),
        (["--set", "strategy_options.pin_mem=false"], ("unknown config key", "strategy_options.pin_mem", "did you mean 'strategy_options.pin_memory'?")),
        (["--set", "lr=fast"], ("lr", "fast")),
        (["--micro-batch", "x"], ("--micro-batch", "positive integer or 'auto'", "'x'")),
        (["--precision", "fp8"], ("precision", "fp8")),
        (["--dropout", "1.5"], ("dropout", "1.5")),
    ],
)
def test_bad_flags_are_user_errors(argv, words):
    with pytest.raises(UserError) as err:
        cfg_from_cli(*argv)
    for word in words:
        assert word in str(err.value)


def test_yaml_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(UserError, match="not valid YAML at line"):
        load_config(write(tmp_path, "bad.yaml", "lr: 1\nmodel: [x\n"))
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(write(tmp_path, "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(UserError, match="unknown config key 'curriculum.0.datset' .*did you mean 'curriculum.0.dataset'"):
        load_config(write(tmp_path, "cur.yaml", "curriculum:\n  - datset: {source: offline}\n"))
    with pytest.raises(UserError, match="unknown config key 'dataset.qqq' .*the keys of 'dataset' are: answer_only_loss, eval_samples"):
        load_config(write(tmp_path, "far.yaml", "dataset: {qqq: 1}\n"))
    with pytest.raises(UserError, match="'micro_batch'.*'two'"):
        load_config(write(tmp_path, "type.yaml", "micro_batch: two\n"))


def test_dry_run_prints_config_and_deepspeed_json(capsys):
    code = main(["train", "--dry-run", "--strategy", "zero3_offload", "--micro-batch", "2", "--grad-accum", "3", "--seq-len", "64"])
    out = capsys.readouterr().out
    assert code == 0
    head, ds_json = out.split("# DeepSpeed config\n")
    assert "strategy: zero3_offload" in head and "global_batch: 6" in head
    ds = json.loads(ds_json)
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_batch_size"] == 6
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"


# ---- DeepSpeed JSON ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s.startswith("zero") or s == "infinity"])
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_build_ds_config_per_strategy(strategy, device_type, tmp_path):
    cfg = RunConfig(strategy=strategy, lr=3e-4, weight_decay=0.1, max_grad_norm=0.5,
                    strategy_options={"nvme_path": str(tmp_path / "nvme"), "pin_memory": False})  # fmt: skip
    ds = build_ds_config(cfg, "bf16", micro=4, accum=2, world=8, device_type=device_type)
    zero = ds["zero_optimization"]
    expected_stage = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero1_offload": 1, "zero2_offload": 2, "zero3_offload": 3, "infinity": 3}
    assert zero["stage"] == STAGE[strategy] == expected_stage[strategy]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 2, 64)
    assert ds["gradient_clipping"] == 0.5
    # bf16_overflow_check: ZeRO-1/2 on the GPU leave inf/NaN to the gradient norm under nan_policy "stop" (the default)
    quiet = zero["stage"] in (1, 2) and offload_kind(strategy) is None
    assert ds["bf16"] == ({"enabled": True, "check_grad_overflow": False} if quiet else {"enabled": True}) and "fp16" not in ds
    assert ("stage3_prefetch_bucket_size" in zero) == (zero["stage"] == 3)
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is False
        assert zero["stage3_max_reuse_distance"] == cfg.strategy_options.stage3_max_reuse_distance  # the planner models it

    kind = offload_kind(strategy)
    if kind is None:
        assert "offload_optimizer" not in zero and "offload_param" not in zero
    elif kind == "cpu":
        assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
        assert ("offload_param" in zero) == (zero["stage"] == 3)
        if zero["stage"] == 3:
            assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    else:
        for section in ("offload_optimizer", "offload_param"):
            assert zero[section]["device"] == "nvme" and zero[section]["pin_memory"] is False
            assert zero[section]["nvme_path"] == str((tmp_path / "nvme").resolve())

    # DeepSpeed's own AdamW where it has a kernel (GPU, or CPU-Adam for offload); torch's AdamW on a CPU-only run
    if device_type == "cuda" or kind is not None:
        assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}
        assert "zero_allow_untested_optimizer" not in ds
    else:
        assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize("strategy", ["zero0", "zero1", "zero2", "zero3", "zero1_offload", "zero2_offload"])
@pytest.mark.parametrize("nan_policy", ["stop", "skip"])
def test_bf16_overflow_check_only_where_deepspeed_must_skip(strategy, nan_policy, tmp_path):
    # DeepSpeed's per-gradient inf/NaN check (and its .item()) is most of zero1/zero2's host time on one GPU; under "stop"
    # the global norm (+inf on a non-finite gradient) stops the run at that step; "skip" needs DeepSpeed to skip the update
    cfg = RunConfig(strategy=strategy, nan_policy=nan_policy, max_grad_norm=None)
    ds = build_ds_config(cfg, "bf16", 8, 1, 1, "cuda")
    quiet = nan_policy == "stop" and strategy in ("zero1", "zero2")
    assert ds["bf16"].get("check_grad_overflow", True) is not quiet
    assert ds["zero_optimization"].get("compute_grad_norm", True) is True  # the norm is what catches a non-finite gradient
    assert "check_grad_overflow" not in json.dumps(build_ds_config(cfg, "fp16", 8, 1, 1, "cuda"))  # fp16 always checks
    # a user's JSON has the last word
    cfg = RunConfig(strategy=strategy, nan_policy=nan_policy, deepspeed_config=user_json(tmp_path, {"bf16": {"check_grad_overflow": True}}))
    assert resolved_ds_config(cfg, "bf16", 8, 1, 1, "cuda")["bf16"] == {"enabled": True, "check_grad_overflow": True}


def test_build_ds_config_precision_sections_and_pinning():
    cfg = RunConfig(strategy="zero2_offload", max_grad_norm=None)
    fp16 = build_ds_config(cfg, "fp16", 1, 1, 1, "cuda")
    assert fp16["fp16"]["enabled"] is True and fp16["fp16"]["loss_scale"] == 0 and "bf16" not in fp16  # dynamic scaling
    fp32 = build_ds_config(cfg, "fp32", 1, 1, 1, "cuda")
    assert "fp16" not in fp32 and "bf16" not in fp32
    assert fp32["gradient_clipping"] == 0.0  # no clipping
    assert fp32["zero_optimization"]["offload_optimizer"]["pin_memory"] is True  # the default


def user_json(tmp_path: Path, data: dict | str) -> str:
    path = tmp_path / "ds.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_user_deepspeed_json_auto_values_are_filled(tmp_path):
    path = user_json(tmp_path, {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "sub_group_size": 1000000},
    })  # fmt: skip
    cfg = RunConfig(strategy="zero3", lr=2e-4, weight_decay=0.05, max_grad_norm=1.0, deepspeed_config=path)
    base = build_ds_config(cfg, "bf16", micro=2, accum=4, world=2, device_type="cuda")
    ds = resolved_ds_config(cfg, "bf16", micro=2, accum=4, world=2, device_type="cuda")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (2, 4, 16)
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.05}
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == base["zero_optimization"]["reduce_bucket_size"]
    assert zero["stage3_prefetch_bucket_size"] == base["zero_optimization"]["stage3_prefetch_bucket_size"]
    assert zero["sub_group_size"] == 1000000  # the user's own keys are kept
    assert zero["overlap_comm"] == base["zero_optimization"]["overlap_comm"]  # and ours fill the rest
    assert "auto" not in json.dumps(ds)
    assert merge_user_config(base, path, "bf16", cfg) == ds


def test_user_deepspeed_json_auto_lr_comes_from_the_run_config(tmp_path):
    # CPU without offload: shardlab passes torch's AdamW, so the generated JSON has no optimizer section
    path = user_json(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}})
    cfg = RunConfig(strategy="zero2", lr=3e-4, weight_decay=0.1, deepspeed_config=path)
    assert "optimizer" not in build_ds_config(cfg, "fp32", 2, 1, 1, "cpu")
    ds = resolved_ds_config(cfg, "fp32", 2, 1, 1, "cpu")
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.1}


def test_user_deepspeed_json_hjson_and_explicit_matching_values(tmp_path):
    path = user_json(tmp_path, '{\n  // a comment\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,},\n}')
    cfg = RunConfig(strategy="zero2", deepspeed_config=path)
    ds = resolved_ds_config(cfg, "fp32", 2, 1, 4, "cpu")
    assert ds["train_batch_size"] == 8 and ds["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize(
    "data,precision,words",
    [
        ({"train_batch_size": 999}, "bf16", ("train_batch_size=999", "resolves it to 16")),
        ({"train_micro_batch_size_per_gpu": 3}, "bf16", ("train_micro_batch_size_per_gpu=3", "resolves it to 2")),
        ({"gradient_accumulation_steps": 1}, "bf16", ("gradient_accumulation_steps=1", "resolves it to 4")),
        ({"bf16": {"enabled": True}}, "fp32", ("bf16", "precision is fp32")),
        ({"fp16": {"enabled": True}}, "bf16", ("fp16", "precision is bf16")),
        ({"zero_optimization": {"stage": 2}}, "bf16", ("stage=2", "ZeRO-3", "--strategy zero2")),
        ({"zero_optimization": {"sub_group_size": "auto"}}, "bf16", ("'sub_group_size' is 'auto'",)),
        ("{not json", "bf16", ("not valid JSON",)),
    ],
)
def test_user_deepspeed_json_conflicts(tmp_path, data, precision, words):
    # an explicit --precision: with 'auto' the JSON's own precision is used where the device runs it (adopt_user_json)
    cfg = RunConfig(strategy="zero3", precision=precision, deepspeed_config=user_json(tmp_path, data))
    with pytest.raises(UserError) as err:
        resolved_ds_config(cfg, precision, micro=2, accum=4, world=2, device_type="cuda")
    for word in words:
        assert word in str(err.value)


def test_user_deepspeed_json_missing(tmp_path):
    cfg = RunConfig(strategy="zero2", deepspeed_config=str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="not found"):
        resolved_ds_config(cfg, "fp32", 2, 1, 1, "cpu")


# ---- TORCH_CUDA_ARCH_LIST ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,fixed",
    [
        ("9.0a", "9.0"),
        ("8.0;9.0a+PTX", "8.0 9.0+PTX"),
        ("9.0a;9.0", "9.0"),  # duplicates after the fix collapse
        ("10.0f 12.0a", "10.0 12.0"),
        ("7.5,8.6", "7.5 8.6"),
    ],
)
def test_sanitize_cuda_arch_list(monkeypatch, raw, fixed):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", raw)
    logged: list[str] = []
    sanitize_cuda_arch_list(log=logged.append)
    import os

    assert os.environ["TORCH_CUDA_ARCH_LIST"] == fixed
    assert len(logged) == 1 and repr(raw) in logged[0] and repr(fixed) in logged[0]


def test_sanitize_cuda_arch_list_leaves_good_values_alone(monkeypatch):
    import os

    logged: list[str] = []
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0+PTX")
    sanitize_cuda_arch_list(log=logged.append)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0+PTX" and not logged
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    sanitize_cuda_arch_list(log=logged.append)
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ and not logged


# ---- learning-rate schedule ------------------------------------------------------------------------------------


def test_warmup_then_cosine_to_min():
    fn = lr_lambda(RunConfig(warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1), total_steps=20)
    assert [fn(s) for s in range(4)] == pytest.approx([0.0, 0.25, 0.5, 0.75])  # linear warm-up from 0, as transformers'
    assert fn(4) == pytest.approx(1.0)
    assert fn(12) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert fn(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert fn(20) == pytest.approx(0.1) and fn(30) == pytest.approx(0.1)  # the floor, and it stays there
    after = [fn(s) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(after, after[1:]))


def test_linear_constant_and_default_floor():
    linear = lr_lambda(RunConfig(warmup_steps=0, lr_schedule="linear", min_lr_ratio=0.2), total_steps=10)
    assert [linear(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.6, 0.2])
    constant = lr_lambda(RunConfig(warmup_steps=2, lr_schedule="constant"), total_steps=10)
    assert [constant(s) for s in (0, 1, 2, 9, 50)] == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0])
    cosine = lr_lambda(RunConfig(), total_steps=10)  # defaults: no warm-up, cosine to 0
    assert cosine(0) == pytest.approx(1.0) and cosine(10) == pytest.approx(0.0)
    short = lr_lambda(RunConfig(warmup_steps=10), total_steps=5)  # all warm-up: never beyond the peak
    assert [short(s) for s in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("schedule, floor, hf_name", [("cosine", 0.0, "cosine"), ("cosine", 0.1, "cosine_with_min_lr"),
                                                      ("linear", 0.0, "linear"), ("constant", 0.0, "constant_with_warmup")])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedules_are_transformers_schedules(schedule, floor, hf_name, warmup):
    """The rate of every step is the one transformers' get_scheduler gives the same settings: a run and its Trainer twin
    step alike (test_token_loss.py compares whole runs)."""
    from transformers import get_scheduler

    steps = 12
    cfg = RunConfig(lr=1e-3, warmup_steps=warmup, lr_schedule=schedule, min_lr_ratio=floor)
    ours = scheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr), cfg, steps)
    hf_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    extra = {"scheduler_specific_kwargs": {"min_lr_rate": floor}} if hf_name == "cosine_with_min_lr" else {}
    theirs = get_scheduler(hf_name, hf_opt, num_warmup_steps=warmup, num_training_steps=steps, **extra)
    got, want = [], []
    for _ in range(steps):
        got.append(ours.get_last_lr()[0])
        want.append(theirs.get_last_lr()[0])
        for sched in (ours, theirs):
            sched.optimizer.step()
            sched.step()
    assert got == pytest.approx(want, abs=1e-12)


def test_scheduler_drives_the_optimizer_lr():
    cfg = RunConfig(lr=1e-3, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.0)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = scheduler(opt, cfg, total_steps=6)
    fn = lr_lambda(cfg, 6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1e-3 * fn(s) for s in range(6)])
    assert seen[0] == 0.0 and seen[1] == pytest.approx(5e-4) and seen[2] == pytest.approx(1e-3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)


# ---- parameter groups ------------------------------------------------------------------------------------------


def test_param_groups_decay_matrices_only():
    from shardlab.training.models import build_model

    model = build_model(RunConfig(model="tiny-gpt2"))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert "transformer.wte.weight" in decayed and "transformer.h.0.attn.c_attn.weight" in decayed
    assert "transformer.h.0.ln_1.weight" in kept and "transformer.h.0.attn.c_attn.bias" in kept and "transformer.ln_f.bias" in kept
    # every trainable parameter exactly once (the tied lm_head/wte included once)
    all_ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(all_ids) == len(set(all_ids)) == len(list(model.parameters()))

    opt = adamw(model, RunConfig(lr=1e-4, weight_decay=0.1, adam_beta2=0.95), "cpu")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.defaults["lr"] == 1e-4 and opt.defaults["betas"] == (0.9, 0.95) and not opt.defaults.get("fused")


def test_param_groups_without_weight_decay_are_one_group():
    """Decay 0 makes the split moot: one group, so fused AdamW runs once per step, as a bare loop's does."""
    from shardlab.training.models import build_model

    model = build_model(RunConfig(model="tiny-gpt2"))
    model.transformer.wpe.requires_grad_(False)
    (group,) = param_groups(model, 0.0)
    assert group["weight_decay"] == 0.0
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters() if p.requires_grad]
    ids = {id(p) for p in group["params"]}
    assert id(model.transformer.wpe.weight) not in ids and id(model.transformer.ln_f.bias) in ids
    assert len(adamw(model, RunConfig(weight_decay=0.0), "cpu").param_groups) == 1


def test_param_groups_without_vectors_and_frozen_params():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2))
    model[1].requires_grad_(False)
    groups = param_groups(model, 0.01)
    assert len(groups) == 1 and groups[0]["params"] == [model[0].weight]
