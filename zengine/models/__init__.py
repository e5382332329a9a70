"""Models and data for the examples and benchmarks (not part of the engine)."""

from .data import ByteWindows, load_corpus
from .gpt import GPT, GPTConfig, bench20m, bench100m, tiny

__all__ = ["GPT", "GPTConfig", "tiny", "bench20m", "bench100m", "ByteWindows", "load_corpus"]
