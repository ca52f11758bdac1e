"""shardlab: fine-tune Hugging Face causal LMs under every memory/parallelism strategy, measured honestly."""

__version__ = "0.1.0"

from .config import RunConfig, load_config  # noqa: E402,F401
from .errors import UserError  # noqa: E402,F401
