"""`fsdp_offload`: FSDP2 with CPUOffloadPolicy. The engine is fsdp's (strategies/fsdp.py reads the offload
fields of this spec), so the name needs nothing but this declaration."""

from .registry import StrategySpec, register

register(StrategySpec(
    name="fsdp_offload", engine="fsdp2", order=10, impl=".fsdp:FSDPStrategy",
    memory=".memory.fsdp:FSDPMemory",
    help="FSDP2 + CPUOffloadPolicy: sharded states kept on the CPU, optimizer step on the CPU",
    sharded=frozenset({"params", "grads", "optimizer"}), offload_params="cpu", offload_optimizer="cpu",
    checkpoint_format="torch_dcp", graph_breaks_per_block=True, uses_autocast=False, supports_8bit=True, supports_in_backward=True,
    adapters=frozenset({"lora"}),
    speed_rank=9, speed_measured=True,  # bloom-7b1, one H100: after ao_offload, before zero3_offload (benchmarks/results/*-h100-big-model)
    oom_next="zero3_offload",
))
