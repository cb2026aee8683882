"""Training data for the main job: a shipped public-domain corpus (see SOURCES.md), a
byte-level tokenizer (no download) and a DP-sharded, seed-deterministic batch sampler."""
from .corpus import CORPUS_FILES, corpus_path, load_corpus_bytes
from .loader import BatchSampler, DataConfig
from .tokenizer import ByteTokenizer

__all__ = ["CORPUS_FILES", "BatchSampler", "ByteTokenizer", "DataConfig", "corpus_path", "load_corpus_bytes"]
