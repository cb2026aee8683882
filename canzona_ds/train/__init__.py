"""The main training job (DeepSpeed ZeRO-1): config, loop, timing, artifacts, comparison."""
from .config import RunConfig, load_run_config

__all__ = ["RunConfig", "load_run_config"]
