"""ZeRO stages: shard arithmetic, flat groups, gradient stores and the stage optimizer."""
from .stages import build_zero_optimizer

__all__ = ["build_zero_optimizer"]
