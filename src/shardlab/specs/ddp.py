"""`dp` (strategies/ddp.py): torch DDP, everything replicated."""

from .registry import StrategySpec, register

register(StrategySpec(
    name="dp", engine="ddp", order=0, impl=".ddp:DDPStrategy", memory=".memory.ddp:DDPMemory",
    help="PyTorch DDP: every GPU holds fp32 weights, gradients and AdamW states",
    checkpoint_format="torch_dcp", supports_8bit=True, supports_in_backward=True, supports_bf16_master=True,
    adapters=frozenset({"lora", "qlora"}), speed_rank=0, speed_measured=True, multi_gpu_speed_rank=4, multi_gpu_speed_measured=True, pin_measured=True, oom_next="zero2",
))
