"""Models used by the main job and the benchmarks.

``qwen3_pipe`` (not imported here: it needs DeepSpeed) is the Qwen3 decoder as a DeepSpeed
``PipelineModule`` with build_model's initial values."""
from .qwen3 import PRESETS, Qwen3Config, Qwen3ForCausalLM, build_model, preset

__all__ = ["PRESETS", "Qwen3Config", "Qwen3ForCausalLM", "build_model", "preset"]
