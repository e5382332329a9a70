"""The precision of the model states the optimizer owns: ``MasterPrecision``, chosen once.

fp32 (the default): fp32 master weights, fp32 master gradients, fp32 Adam moments: 4 + 4 + 8
bytes per parameter beside the compute-dtype parameter and gradient. DeepSpeed's
``fp16.fp16_master_weights_and_grads`` makes the masters and their gradients fp16 (fp32 moments,
rounded to nearest: 2 + 2 + 8 = 12 bytes); its
``bf16.bf16_master_weights_and_grads`` makes the masters and their gradients bf16 (where the
masters live with the parameters, the bf16 parameter shard *is* the master: no copy at all), and
``bf16.bf16_optimizer_states`` the moments: 2 + 2 + 2 + 2 = 8 bytes per parameter, sharded as
the stage shards them. ``bf16.master_rounding`` says how the bf16 master stores each update
(``ops/adam_bf16.py``); Kahan keeps a bf16 compensation beside it (10 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..ops.adam_bf16 import Rounding

if TYPE_CHECKING:  # annotations only
    from ..config.models import ZengineConfig


@dataclass(frozen=True)
class MasterPrecision:
    """The dtypes of the masters, their gradients and the optimizer states, and the rounding."""

    dtype: torch.dtype = torch.float32  # masters and master gradients
    states: torch.dtype = torch.float32  # Adam's moments
    rounding: Rounding = Rounding.NEAREST

    @classmethod
    def from_config(cls, config: "ZengineConfig") -> "MasterPrecision":
        """The precision the ``fp16`` and ``bf16`` sections ask for (validated by ``load_config``):
        fp16 masters keep fp32 moments and round to nearest, as DeepSpeed's CPU Adam does."""
        fp16, bf16 = config.fp16, config.bf16
        if fp16.enabled and fp16.fp16_master_weights_and_grads:
            return cls(torch.float16)
        if not (bf16.enabled and bf16.bf16_master_weights_and_grads):
            return cls()
        states = torch.bfloat16 if bf16.bf16_optimizer_states else torch.float32
        return cls(torch.bfloat16, states, Rounding(bf16.master_rounding))

    @property
    def low(self) -> bool:
        """The masters are fp16 or bf16 (DeepSpeed's *_master_weights_and_grads)."""
        return self.dtype != torch.float32

    @property
    def section(self) -> str:
        """The config section whose key chose these masters: "fp16" or "bf16" ("" for fp32)."""
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.dtype, "")

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of a master and what its rounding keeps beside it (Kahan)."""
        return self.dtype.itemsize * (1 + self.rounding.buffers)

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of a master gradient."""
        return self.dtype.itemsize

    @property
    def adam_state_bytes(self) -> int:
        """Bytes per parameter of Adam's two moments."""
        return 2 * self.states.itemsize

    def describe(self) -> str:
        """One line for logs: 'fp32 masters' or 'bf16 masters, bf16 moments, kahan rounding'."""
        if not self.low:
            return "fp32 masters and moments"
        states = "bf16" if self.states == torch.bfloat16 else "fp32"
        return (
            f"{self.section} masters and gradients, {states} moments, "
            f"{self.rounding.value} rounding"
        )
