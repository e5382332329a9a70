"""Adam / AdamW over a bf16 or fp16 master shard: ``adam_step_bf16_`` and the rounding modes.

DeepSpeed's ``bf16.bf16_master_weights_and_grads`` keeps the master weights and their gradients
in bf16; with ``bf16.bf16_optimizer_states`` Adam's moments are bf16 too: 8 bytes of model state
per parameter instead of 16. The arithmetic stays fp32: each element's master, gradient and
moments are widened, updated with ``adam.py``'s operations in the same order, and stored back.
How the updated master is stored is the ``Rounding`` (``bf16.bf16_master_rounding``):

- ``nearest``: round to nearest even (DeepSpeed's behaviour). An update below half a bf16 ulp
  of the weight (2^-9 of it) is lost, every step: the known cost of bf16 masters.
- ``kahan``: the master is a pair of bf16 tensors, the parameter and a compensation that keeps
  what the rounding dropped (2 more bytes per parameter: 10). The next step updates
  ``param + compensation`` in fp32, so small updates accumulate instead of vanishing.
- ``stochastic``: round up with probability (dropped bits) / 2^16, so the stored master is
  the fp32 result in expectation. The 16 random bits of element i are
  ``mix32(key ^ (first_index + i))``: a counter-based hash, so the compiled kernel, its SIMD
  paths, any thread count and the torch fallback all draw the same bits.

DeepSpeed's ``fp16.fp16_master_weights_and_grads`` is the fp16 counterpart: fp16 masters and
gradients, fp32 moments, the same fp32 arithmetic, each master rounded to nearest (the kernel's
``adam_step_fp16``: the same lanes with F16C loads and stores).

The compiled ``cpu_adam`` op (csrc/adam/cpu_adam_bf16.cpp) runs it on contiguous CPU tensors;
elsewhere (a GPU, no compiler) ``_torch_adam_step_bf16_`` does the same arithmetic with torch
ops, bit for bit (the tests compare them).
"""

from __future__ import annotations

import enum

import torch

from .builder import load_op

__all__ = [
    "LOW_MASTER_DTYPES",
    "Rounding",
    "adam_step_bf16_",
    "stochastic_bits",
    "round_stochastic",
]

_MASK32 = 0xFFFFFFFF

LOW_MASTER_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes of low-precision masters (``*_master_weights_and_grads``) ``adam_step_bf16_`` steps."""


class Rounding(enum.Enum):
    """How an updated bf16 master is stored (module doc); the kernel's codes."""

    NEAREST = "nearest"
    KAHAN = "kahan"
    STOCHASTIC = "stochastic"

    @property
    def code(self) -> int:
        """The kernel's ``Rounding`` enum value (csrc/adam/cpu_adam.h)."""
        return {"nearest": 0, "kahan": 1, "stochastic": 2}[self.value]

    @property
    def buffers(self) -> int:
        """bf16 buffers this mode keeps per parameter beyond the master (Kahan: the
        compensation)."""
        return 1 if self is Rounding.KAHAN else 0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """csrc's ``mix32`` (lowbias32) on int64 tensors holding uint32 values: the products wrap
    past 2^63 in int64, which keeps their low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def stochastic_bits(n: int, key: int, first_index: int, device=None) -> torch.Tensor:
    """The 16 random bits of elements [0, n) (int64): ``mix32(key ^ (first_index + i)) % 2^16``."""
    index = (torch.arange(n, dtype=torch.int64, device=device) + first_index) & _MASK32
    return _mix32(index ^ (key & _MASK32)) & 0xFFFF


def round_stochastic(x: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 by adding ``random`` (16 bits per element) below the kept bits
    and truncating; infinities stay, NaN becomes 0x7FC0 (the kernel's rule)."""
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    finite = (bits & 0x7FFFFFFF) < 0x7F800000
    kept = ((bits + torch.where(finite, random, 0)) >> 16) & 0xFFFF
    kept = torch.where(torch.isnan(x), 0x7FC0, kept)
    return kept.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # low 16 bits


@torch.no_grad()
def _torch_adam_step_bf16_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    compensation,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    bias_correction,
    adamw_mode,
    rounding: Rounding,
    key: int,
    first_index: int,
) -> None:
    """The kernel's arithmetic as torch ops, element for element (``adam._torch_adam_step_``
    explains the single roundings and the float64 square root)."""
    from .adam import _coefficients, adam_arithmetic_  # (adam.py builds on this module)

    c = _coefficients(lr, beta1, beta2, weight_decay, step, bias_correction)
    p = param.float()  # fp32 copies of the bf16 master (a state already fp32 steps in place)
    if rounding is Rounding.KAHAN:
        p = p + compensation.float()
    g = grad.to(param.dtype).float()  # the mode's gradients are in the master's dtype
    m, v = exp_avg.float(), exp_avg_sq.float()
    adam_arithmetic_(p, g, m, v, c, beta2, eps, weight_decay, adamw_mode)
    exp_avg.copy_(m)  # to nearest where the moments are bf16
    exp_avg_sq.copy_(v)
    if rounding is Rounding.STOCHASTIC:
        random = stochastic_bits(p.numel(), key, first_index, p.device).view(p.shape)
        param.copy_(round_stochastic(p, random))
        return
    param.copy_(p)
    if rounding is Rounding.KAHAN:
        compensation.copy_(p - param.float())


def _kernel_can_step(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None
        or (
            t.device.type == "cpu"
            and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and t.is_contiguous()
        )
        for t in tensors
    )


@torch.no_grad()
def adam_step_bf16_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    compensation: torch.Tensor | None = None,
    rounding: Rounding = Rounding.NEAREST,
    key: int = 0,
    first_index: int = 0,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    simd: str | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam (``adamw_mode=False``: L2) or AdamW step over one bf16 or fp16 master shard, in
    place.

    Args:
        param: [n] bf16 or fp16, the master (and, at stages 1-2 without offload, the parameters).
        grad: [n] its gradient; one of another dtype is rounded to the master's first (the mode's
            gradients are in the master's dtype), on both paths.
        exp_avg, exp_avg_sq: [n] bf16 (``bf16_optimizer_states``) or fp32, the same dtype; fp32
            for an fp16 master (as DeepSpeed's CPU Adam keeps them).
        compensation: [n] bf16, Kahan's; required for ``Rounding.KAHAN``, else unused.
        rounding, key, first_index: how the master is stored (module doc); ``key`` and
            ``first_index`` seed stochastic rounding (give each step its own key).
        simd, num_threads: as ``adam.adam_step_``.
    """
    from .adam import _SIMD_CODES  # adam.py builds on this module: imported when used

    n = param.numel()
    if param.dtype not in LOW_MASTER_DTYPES:
        raise ValueError(f"adam_step_bf16_: param must be bf16 or fp16, got {param.dtype}")
    if param.dtype == torch.float16 and (
        exp_avg.dtype != torch.float32 or rounding is not Rounding.NEAREST
    ):
        raise ValueError(
            "adam_step_bf16_: an fp16 master keeps fp32 moments and rounds to nearest "
            f"(got {exp_avg.dtype} moments, {rounding.value} rounding)"
        )
    if exp_avg.dtype != exp_avg_sq.dtype or exp_avg.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("adam_step_bf16_: exp_avg and exp_avg_sq must both be bf16 or both fp32")
    if rounding is Rounding.KAHAN and (
        compensation is None or compensation.dtype != torch.bfloat16
    ):
        raise ValueError("adam_step_bf16_: Kahan rounding needs a bf16 compensation tensor")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.numel() != n:
            raise ValueError(f"adam_step_bf16_: {name} has {t.numel()} elements, param has {n}")
    if simd not in _SIMD_CODES:
        raise ValueError(f"simd must be one of scalar, avx2, avx512 or None, got {simd!r}")
    beta1, beta2 = betas
    comp = compensation if rounding is Rounding.KAHAN else None
    kernel = None
    entry = "adam_step_fp16" if param.dtype == torch.float16 else "adam_step_bf16"
    if _kernel_can_step(param, exp_avg, exp_avg_sq, comp) and grad.device.type == "cpu":
        kernel = load_op("cpu_adam")
    if kernel is None or not hasattr(kernel, entry):
        _torch_adam_step_bf16_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            comp,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=step,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            rounding=rounding,
            key=key,
            first_index=first_index,
        )
        return
    if grad.dtype != param.dtype or not grad.is_contiguous():
        grad = grad.to(param.dtype).contiguous()
    getattr(kernel, entry)(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        comp.data_ptr() if comp is not None else 0,
        n,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        bool(bias_correction),
        bool(adamw_mode),
        exp_avg.dtype == torch.bfloat16,
        rounding.code,
        int(key) & _MASK32,
        int(first_index) & _MASK32,
        num_threads if num_threads is not None else torch.get_num_threads(),
        _SIMD_CODES[simd],
    )
