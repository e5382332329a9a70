"""The dtypes a gradient passes through between autograd and the step, chosen once from the config.

    compute     autograd's: the parameters' dtype in forward and backward (fp16, bf16 or fp32)
    reduce      the bucket buffers summed across ranks (``communication_data_type``)
    accumulate  the sum over micro-steps (``data_types.grad_accum_dtype``): this rank's gradient shard at
                stages 2-3, the full gradient buffer at stages 0-1

Defaults, and why:

- ``reduce``: the compute dtype. DeepSpeed (its engine falls back to the fp16/bf16 mode) and FSDP2
  (``MixedPrecisionPolicy.reduce_dtype=None`` reduces in ``param_dtype``) both do so: an fp32 reduction
  of 16-bit gradients doubles every bucket, on the wire and in memory. But a 16-bit reduction may round
  at each rank's addition (gloo's does), so its error grows with the world size, and an fp16 sum of W
  gradients overflows at 65504 though each one fits (zengine divides by W at the step):
  ``"communication_data_type": "fp32"`` trades the bucket bytes for one rounding at the end
  (``tests/zero/test_zero_reduce_dtype.py`` measures both).
- ``accumulate``: the master gradient's dtype at stages 2-3 (fp32; bf16 with DeepSpeed's
  ``bf16_master_weights_and_grads``, whose gradients are bf16), fp32 as FSDP2 does (each reduced shard is cast to the fp32 sharded
  parameter's dtype and added into its ``.grad``). It costs 2 bytes per element of the shard during
  backward and saves 2 at the step: the fp32 shard is itself the master gradient the step reads, where a
  16-bit shard needs an fp32 copy made there (``masters.MastersInMemory.grads``). At stages 0-1 the
  compute dtype, DeepSpeed's default: the accumulator is the full gradient, which the parameters' ``.grad``
  view; fp32 there doubles a model-sized buffer and leaves ``.grad`` None after backward (DeepSpeed's
  ``grad_accum`` does the same). With optimizer offload the host shard is fp32 whatever is chosen, as in
  DeepSpeed (``placement.cpu_optimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ..config.precision import DTYPES
from ..precision.masters import MasterPrecision

if TYPE_CHECKING:  # annotations only
    from ..config import ZengineConfig


@dataclass(frozen=True)
class ReduceScaling:
    """Where the mean over the data-parallel ranks is taken. By default (``in_reduce`` False) the
    ranks sum and the step divides by the world size, in fp32. DeepSpeed's ``prescale_gradients``
    (``before`` = 1/world) and ``gradient_predivide_factor`` f (``before`` = 1/f, ``after`` =
    f/world) multiply each bucket, in its reduce dtype, before and after the reduction instead: an
    fp16 sum stays in range, and rounds where DeepSpeed's does."""

    before: float = 1.0
    after: float = 1.0
    in_reduce: bool = False

    @classmethod
    def from_config(cls, config: ZengineConfig, world: int) -> "ReduceScaling":
        """The scaling ``prescale_gradients`` and ``gradient_predivide_factor`` ask for over
        ``world`` data-parallel ranks."""
        if config.prescale_gradients:
            return cls(1.0 / world, 1.0, True)
        factor = float(config.gradient_predivide_factor)
        if factor != 1.0:
            return cls(1.0 / factor, factor / world, True)
        return cls()

    def world_at_step(self, world: int) -> int:
        """What the step still divides by for the mean: 1 when the reduction took it."""
        return 1 if self.in_reduce else world

    def scale(self, wire: torch.Tensor, factor: float) -> torch.Tensor:
        """``wire`` times ``factor``, in place, in its own dtype (DeepSpeed's rounding)."""
        return wire if factor == 1.0 else wire.mul_(factor)


@dataclass(frozen=True)
class GradDtypes:
    """The compute, reduce and accumulate dtypes of one engine's gradients (module doc); ``own``:
    the parameters (by ``id``) whose gradients cross the ranks in a dtype of their own (under
    ``torch_autocast``, precision/autocast.py), ``scaling``: where the mean over ranks is taken."""

    compute: torch.dtype
    reduce: torch.dtype
    accumulate: torch.dtype
    own: Mapping[int, torch.dtype] = field(default_factory=dict)
    scaling: ReduceScaling = ReduceScaling()

    def wire(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param``'s gradient crosses the ranks in."""
        return self.own.get(id(param), self.reduce)

    def wires(self, params: Sequence[torch.Tensor]) -> list[torch.dtype]:
        """``wire`` of each parameter: a bucket holds parameters of one wire dtype only."""
        return [self.wire(p) for p in params]

    master: torch.dtype = torch.float32  # the master gradient's (bf16_master_weights_and_grads)

    @classmethod
    def from_config(
        cls,
        config: ZengineConfig,
        own: Mapping[int, torch.dtype] = {},
        world: int = 1,
    ) -> "GradDtypes":
        """The dtypes ``config`` (a ``ZengineConfig``) asks for, defaults resolved for its stage;
        ``own`` and ``world`` (the data-parallel ranks) as the engine found them."""
        compute = config.compute_dtype
        named = config.communication_data_type or ("fp32" if config.fp32_allreduce else None)
        reduce = DTYPES[named] if named else compute
        chosen = config.data_types.grad_accum_dtype
        masters = MasterPrecision.from_config(config).dtype
        if chosen is not None:
            accumulate = DTYPES[chosen]
        else:
            accumulate = masters if config.zero_optimization.stage >= 2 else compute
        scaling = ReduceScaling.from_config(config, world)
        return cls(compute, reduce, accumulate, dict(own), scaling, masters)

    @property
    def grad_lands_in_bucket(self) -> bool:
        """A gradient may be reduced itself (stage 3: a bucket that is one unpadded parameter) rather than copied
        into a bucket buffer: only when the bucket has the gradient's dtype."""
        return self.reduce == self.compute

    def shard_dtype(self, cpu_optimizer: bool) -> torch.dtype:
        """The dtype of the gradient shard (stages 2-3): the master gradient's (fp32, or bf16 with
        bf16 masters) where the CPU optimizer steps on it."""
        return self.master if cpu_optimizer else self.accumulate
