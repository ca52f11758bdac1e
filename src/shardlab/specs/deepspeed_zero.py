"""zero0-3, their ZeRO-Offload variants and `infinity` (strategies/deepspeed_zero.py): one engine, many names."""

from .registry import StrategySpec, register

# ZeRO-Infinity keeps fp32 master + Adam m and v (12 B) and a 16-bit param copy (2 B) per parameter on NVMe.
# Here (light) so that the planner and the engine's NVMe check read one number.
NVME_BYTES_PER_PARAM = 14

# Shared by every DeepSpeed name: the engine casts the module itself (no autocast); --compile is DeepSpeed's own
# engine.compile (DeepSpeedStrategy.setup).
_DS = dict(engine="deepspeed", impl=".deepspeed_zero:DeepSpeedStrategy", memory=".memory.deepspeed_zero:DeepSpeedMemory",
           supports_compile=True, uses_autocast=False,
           # qlora: the engine casts the whole module to its dtype, and ZeRO-3 partitions 4-bit layers' packed bytes
           adapters=frozenset({"lora"}))
_SHARDED = {1: frozenset({"optimizer"}), 2: frozenset({"optimizer", "grads"}), 3: frozenset({"optimizer", "grads", "params"})}

register(StrategySpec(name="zero0", order=1, zero_stage=0, help="DeepSpeed with ZeRO off: DDP's memory, DeepSpeed's engine",
                      checkpoint_format="deepspeed_stage0", speed_rank=1, multi_gpu_speed_rank=5, oom_next="zero2", **_DS))
# Speed ranks: benchmarks/results/h100-foundation.md (tok/s, gpt2-medium, 1 x H100) for zero2, zero3, zero2_offload;
# the rest placed by reasoning (planner.py keeps the measured figures). pin_measured: zero1-3 ran pinned
# (runtime/pin.py; benchmarks/results/*-h100-zero3-pin/); zero0 was not measured. On several GPUs (multi): the order two
# H200s measured (planning/planner.py). graph_breaks_per_block: ZeRO-3's hooks around every module split a compiled
# model into a graph per block (training/compiling.py), as FSDP2's do.
for stage, rank, measured, multi, nxt in ((1, 2, False, 1, "zero2"), (2, 3, True, 0, "zero3"), (3, 5, True, 3, "zero3_offload")):
    register(StrategySpec(name=f"zero{stage}", order=1 + stage, zero_stage=stage, sharded=_SHARDED[stage],
                          help=f"DeepSpeed ZeRO-{stage}: {' + '.join(sorted(_SHARDED[stage]))} sharded across GPUs",
                          checkpoint_format="deepspeed_zero", speed_rank=rank, speed_measured=measured, pin_measured=True,
                          graph_breaks_per_block=stage == 3, multi_gpu_speed_rank=multi, multi_gpu_speed_measured=True,
                          oom_next=nxt, **_DS))
for stage, rank, measured, nxt in ((1, 8, False, "zero2_offload"), (2, 6, True, "zero3_offload")):
    register(StrategySpec(name=f"zero{stage}_offload", order=4 + stage, zero_stage=stage, sharded=_SHARDED[stage],
                          offload_optimizer="cpu", supports_zenflow=True,
                          help=f"DeepSpeed ZeRO-{stage} + ZeRO-Offload: optimizer states and the Adam step on the CPU",
                          checkpoint_format="deepspeed_zero", speed_rank=rank, speed_measured=measured, oom_next=nxt, **_DS))
register(StrategySpec(name="zero3_offload", order=7, zero_stage=3, sharded=_SHARDED[3], offload_params="cpu",
                      offload_optimizer="cpu", help="DeepSpeed ZeRO-3 + offload: parameters and optimizer states on the CPU",
                      checkpoint_format="deepspeed_zero", graph_breaks_per_block=True, speed_rank=10, oom_next="infinity", **_DS))
register(StrategySpec(name="infinity", order=8, zero_stage=3, sharded=_SHARDED[3], offload_params="nvme",
                      offload_optimizer="nvme", help="DeepSpeed ZeRO-Infinity: parameters and optimizer states on NVMe",
                      checkpoint_format="deepspeed_nvme", graph_breaks_per_block=True, speed_rank=11, oom_next="more GPUs",
                      **{**_DS, "adapters": frozenset()}))  # adapters with the NVMe swap: not tried
