"""Models used by the main job and the benchmarks."""
from .qwen3 import PRESETS, Qwen3Config, Qwen3ForCausalLM, build_model, preset

__all__ = ["PRESETS", "Qwen3Config", "Qwen3ForCausalLM", "build_model", "preset"]
