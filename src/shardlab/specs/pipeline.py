"""`pipeline` (strategies/pipeline.py): torch.distributed.pipelining, layers split across GPUs."""

from .registry import StrategySpec, register

register(StrategySpec(
    name="pipeline", engine="pipelining", order=12, impl=".pipeline:PipelineStrategy",
    memory=".memory.pipeline:PipelineMemory",
    help="torch.distributed.pipelining (GPipe, 1F1B): each GPU holds a contiguous slice of blocks",
    checkpoint_format="torch_dcp", supports_compile=False,
    own_loss=True,  # transformers' loss on the last stage, applied per micro-batch by the schedule
    eval_whole_steps=True,  # the schedule splits every batch, eval ones too, into its micro-batches
    supports_8bit=False, supports_in_backward=False,  # schedules step one torch AdamW per stage: exact AdamW only, for now
    speed_rank=None,  # not ranked in the recommendation: its speed is not measured
))
