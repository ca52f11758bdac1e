"""`fsdp` (strategies/fsdp.py): PyTorch FSDP2, every model state sharded on the GPUs."""

from .registry import StrategySpec, register

register(StrategySpec(
    name="fsdp", engine="fsdp2", order=9, impl=".fsdp:FSDPStrategy", memory=".memory.fsdp:FSDPMemory",
    help="PyTorch FSDP2 (fully_shard per block): parameters, gradients and optimizer states sharded",
    sharded=frozenset({"params", "grads", "optimizer"}), checkpoint_format="torch_dcp", graph_breaks_per_block=True,
    uses_autocast=False,  # MixedPrecisionPolicy already computes in low precision
    supports_8bit=True, supports_in_backward=True,
    adapters=frozenset({"lora"}),  # qlora: FSDP2 shards a 4-bit layer's packed bytes and loses its quantisation state
    speed_rank=4, speed_measured=True, multi_gpu_speed_rank=2, multi_gpu_speed_measured=True, pin_measured=True, oom_next="fsdp_offload",
))
