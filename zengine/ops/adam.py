"""Adam / AdamW on CPU: ``adam_step_`` over one fp32 shard, and the ``CPUAdam`` optimizer.

The compiled ``cpu_adam`` kernel (csrc/adam/cpu_adam.cpp) updates parameter, first and
second moment in one pass over memory and can write the updated parameters a second time,
as fp32, bf16 or fp16, in that same pass (``copy_out``): the mixed-precision offload path
(fp32 master shard on CPU -> compute-dtype shard) needs no separate conversion sweep.

Where the kernel cannot be used (not built, or a tensor that is not a contiguous CPU fp32
tensor) the same arithmetic runs as torch ops, in the same order and rounding (see
``_torch_adam_step_``), so results do not depend on which path ran. Against
``torch.optim.AdamW`` / ``Adam`` they agree to float rounding (the order of a few operations
differs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch

from .adam_bf16 import LOW_MASTER_DTYPES, Rounding, adam_step_bf16_
from .shard_optimizer import ShardOptimizer
from .builder import load_op

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "FusedAdam", "adam_step_", "simd_paths", "simd_path"]

COMPENSATION = "compensation"  # the state key of Kahan's bf16 compensation (bf16 masters)
# Codes of the kernel's CopyOut enum (csrc/adam/cpu_adam.h).
_COPY_OUT_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# Codes of the kernel's SimdPath enum (csrc/includes/dispatch.h).
_SIMD_CODES = {None: -1, "auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}


def simd_paths() -> list[str]:
    """SIMD paths the kernel can run on this CPU, widest first ([] without the kernel)."""
    kernel = load_op("cpu_adam")
    return list(kernel.simd_paths()) if kernel is not None else []


def simd_path() -> str | None:
    """The path the kernel takes when none is named (``ZENGINE_SIMD`` or the widest one)."""
    kernel = load_op("cpu_adam")
    return kernel.simd_path() if kernel is not None else None


def _kernel_can_step(param: torch.Tensor, *others: torch.Tensor | None) -> bool:
    return all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
        for t in (param, *others)
    )


def _coefficients(lr, beta1, beta2, weight_decay, step, bias_correction) -> dict[str, float]:
    """The per-step scalars, in double, exactly as the kernel computes them (make_coeffs)."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    return dict(
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        inv_sqrt_bc2=1.0 / math.sqrt(bc2),
        param_scale=1.0 - lr * weight_decay,
        neg_step_size=-(lr / bc1),
    )


def adam_arithmetic_(
    param, grad, exp_avg, exp_avg_sq, c: dict, beta2, eps, weight_decay, adamw_mode
) -> None:
    """One Adam step in place on tensors of one dtype, with the scalars ``c`` of ``_coefficients``:
    the kernel's operations in its order (``_torch_adam_step_`` says why each is written so).
    The bf16-master fallback (adam_bf16.py) runs it on fp32 copies."""
    if weight_decay != 0.0 and not adamw_mode:
        grad = grad + param * weight_decay
    exp_avg.add_((grad - exp_avg).mul_(c["one_minus_beta1"]))
    exp_avg_sq.mul_(beta2).add_((grad * grad).mul_(c["one_minus_beta2"]))
    denom = (
        torch.sqrt(exp_avg_sq.to(torch.float64)).to(param.dtype).mul_(c["inv_sqrt_bc2"]).add_(eps)
    )
    if weight_decay != 0.0 and adamw_mode:
        param.mul_(c["param_scale"])
    param.add_(exp_avg.div(denom).mul_(c["neg_step_size"]))


@torch.no_grad()
def _torch_adam_step_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    bias_correction,
    adamw_mode,
    copy_out,
) -> None:
    """The kernel's arithmetic as torch ops: same operations, same order, same fp32 roundings.

    Each op below is one IEEE operation per element with its scalar rounded to fp32 once, as
    in the kernel; no ``alpha=``/``value=`` arguments, which torch may fuse into one rounding.
    torch's fp32 ``sqrt`` on CPU is not correctly rounded (about 1 in 6 results is 1 ulp
    off), so the square root is taken in float64 and rounded once, which matches the
    kernel's correctly rounded fp32 square root in all but vanishingly rare cases.
    """
    c = _coefficients(lr, beta1, beta2, weight_decay, step, bias_correction)
    adam_arithmetic_(param, grad.to(param.dtype), exp_avg, exp_avg_sq, c, beta2, eps,
                     weight_decay, adamw_mode)  # fmt: skip
    if copy_out is not None:
        copy_out.copy_(param.reshape(copy_out.shape))


@torch.no_grad()
def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    copy_out: torch.Tensor | None = None,
    simd: str | None = None,
    num_threads: int | None = None,
) -> None:
    """One Adam (``adamw_mode=False``: L2) or AdamW step over one shard, in place.

    Args:
        param, grad, exp_avg, exp_avg_sq: tensors of equal numel; the kernel runs when param and
            the moments are contiguous fp32 CPU tensors and grad is on the CPU (converted to
            contiguous fp32 first if it is not), otherwise the torch ops of the same math do.
        step: this step's number, 1 for the first (bias correction uses it).
        copy_out: also write the updated ``param`` here, same numel, fp32/bf16/fp16; in the
            same pass when it is a contiguous CPU tensor, else by a ``copy_`` afterwards
            (for a device tensor, pass a pinned CPU one instead and copy it yourself to overlap).
        simd: ``"avx512"``, ``"avx2"`` or ``"scalar"`` to force a path (error if the CPU lacks
            it); None: ``ZENGINE_SIMD``, else the widest the CPU has.
        num_threads: OpenMP threads; default ``torch.get_num_threads()``.
    """
    beta1, beta2 = betas
    n = param.numel()
    for name, t in (
        ("grad", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
        ("copy_out", copy_out),
    ):
        if t is not None and t.numel() != n:
            raise ValueError(f"adam_step_: {name} has {t.numel()} elements, param has {n}")
    if simd not in _SIMD_CODES:
        raise ValueError(
            f"simd must be one of {sorted(k for k in _SIMD_CODES if k)} or None, got {simd!r}"
        )
    fused_copy = (
        copy_out is not None
        and copy_out.dtype in _COPY_OUT_CODES
        and copy_out.device.type == "cpu"
        and copy_out.is_contiguous()
    )
    kernel = None
    if _kernel_can_step(param, exp_avg, exp_avg_sq) and grad.device.type == "cpu":
        kernel = load_op("cpu_adam")
    if kernel is not None and not _kernel_can_step(grad):
        grad = grad.to(torch.float32).contiguous()  # e.g. a bf16 gradient: one conversion pass
    if kernel is None:
        _torch_adam_step_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=step,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            copy_out=copy_out,
        )
        return
    kernel.adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        bool(bias_correction),
        bool(adamw_mode),
        copy_out.data_ptr() if fused_copy else 0,
        _COPY_OUT_CODES[copy_out.dtype] if fused_copy else 0,
        num_threads if num_threads is not None else torch.get_num_threads(),
        _SIMD_CODES[simd],
    )
    if copy_out is not None and not fused_copy:
        # blocking: the next step rewrites ``param`` in place, and a queued copy has no event to wait on (the
        # engine's own targets are host staging, uploaded on a side stream by offload/copies.py)
        copy_out.copy_(param.reshape(copy_out.shape))


class CPUAdam(torch.optim.Optimizer, ShardOptimizer):
    """Adam/AdamW for CPU parameters on the compiled SIMD kernel (DeepSpeed's ``DeepSpeedCPUAdam``).

    Same arguments and results as ``torch.optim.AdamW`` (``adamw_mode=True``, decoupled weight
    decay) or ``torch.optim.Adam`` (``adamw_mode=False``, L2), to float rounding, plus
    ``bias_correction=False``. Each of these may also be set per param group. State per
    parameter: ``step`` (a float tensor, as torch keeps it), ``exp_avg``, ``exp_avg_sq``; a
    state dict saved by ``torch.optim.Adam``/``AdamW`` loads into CPUAdam and carries on.

    ``step_with_copy(copy_out)`` also writes the updated parameters into other tensors
    (bf16/fp16/fp32) in the same pass over memory. Parameters that are not contiguous fp32
    CPU tensors, or a machine where the kernel cannot be built, take the torch ops of the same
    arithmetic (one warning names the reason).
    """

    writes_params = (
        True  # ShardOptimizer: step_runs (and step_with_copy) write copies while stepping
    )
    steps_runs = True  # ShardOptimizer: step_runs
    steps_in_pieces = (
        True  # ShardOptimizer: a step as step_runs over pieces (the arithmetic is per element)
    )

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        fp32_optimizer_states: bool = True,
        rounding: Rounding | str = Rounding.NEAREST,
        seed: int = 0,
    ):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self._runs: dict[int, list[tuple[int, int, int]]] = {}  # set for one step by step_runs
        # bf16 parameters (bf16 masters): their moments' dtype, the master rounding, and the seed
        # of stochastic rounding's per-step keys (fp32 parameters use none of these)
        self.bf16_states = torch.float32 if fp32_optimizer_states else torch.bfloat16
        self.rounding = Rounding(rounding)
        self.seed = int(seed)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state dict saved by torch's Adam/AdamW loads too: its groups lack our two options.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One optimizer step over every parameter that has a gradient."""
        return self._step(closure, {})

    @torch.no_grad()
    def step_with_copy(
        self,
        copy_out: Mapping[torch.Tensor, torch.Tensor],
        closure: Callable[[], float] | None = None,
    ):
        """One step that also writes each updated parameter into ``copy_out[param]``.

        ``copy_out`` maps a parameter (by identity) to a tensor of the same numel in fp32, bf16
        or fp16; parameters not in it are only stepped. For a contiguous CPU target the kernel
        writes it in the same pass; any other target gets a ``copy_`` after the step.
        """
        by_id = {id(p): out for p, out in copy_out.items()}
        return self._step(closure, by_id)

    @torch.no_grad()
    def step_runs(
        self,
        runs: Mapping[torch.Tensor, list[tuple[int, int, int]]],
        copy_out: Mapping[torch.Tensor, torch.Tensor],
    ):
        """One step over ranges: for each parameter in ``runs``, elements [lo, hi) at their own step number
        (the ZeRO step keeps torch's count per model parameter inside a flat shard, and leaves out the
        parameters no rank gave a gradient); the rest of it is untouched. ``copy_out`` as in ``step_with_copy``."""
        self._runs = {id(p): list(r) for p, r in runs.items()}
        try:
            return self._step(None, {id(p): out for p, out in copy_out.items()})
        finally:
            self._runs = {}

    def record_steps(self, runs: Mapping[torch.Tensor, list[tuple[int, int, int]]]) -> None:
        """Each parameter's ``state["step"]`` as ``step_runs(runs, ...)`` sets it, without stepping: after a step
        taken as ``step_runs`` calls over pieces of ``runs``, each of which showed only its own runs' count."""
        self._runs = {id(p): list(r) for p, r in runs.items()}
        try:
            for _ in self._due():
                pass
        finally:
            self._runs = {}

    def _step(self, closure, copy_out_by_id: Mapping[int, torch.Tensor]):
        loss = self._run_closure(closure)
        for group, param, state, runs in self._due():
            self._step_param(group, param, state, runs, copy_out_by_id.get(id(param)))
        return loss

    def _step_param(self, group: dict, param: torch.Tensor, state: dict, runs, out) -> None:
        """One parameter's runs ((lo, hi, step number) each), its updated values also into ``out``
        (None: nowhere else); its moments made at its first step."""
        low = param.dtype in LOW_MASTER_DTYPES  # a bf16/fp16 master (*_master_weights_and_grads)
        if "exp_avg" not in state:
            states = self._moments_dtype(param)
            state["exp_avg"] = torch.zeros_like(param, dtype=states)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=states)
        if low and self.rounding.buffers and COMPENSATION not in state:
            state[COMPENSATION] = torch.zeros_like(param)
        for lo, hi, step in runs:
            whole = lo == 0 and hi == param.numel()
            names = ("exp_avg", "exp_avg_sq") + (
                ("compensation",) if "compensation" in state else ()
            )
            p, g, m, v, *comp = (
                t if whole else t.view(-1)[lo:hi]
                for t in (param, param.grad, *(state.get(k) for k in names))
            )
            target = out if out is None or whole else out.view(-1)[lo:hi]
            if not low:
                adam_step_(p, g, m, v, step=step, copy_out=target, **self._hyper(group))
                continue
            adam_step_bf16_(
                p,
                g,
                m,
                v,
                step=step,
                compensation=comp[0] if comp else None,
                rounding=self.rounding,
                key=self._key(param, step),
                first_index=lo,
                **self._hyper(group),
            )
            if target is not None:
                target.copy_(p.reshape(target.shape))

    def state_dtype(self, param: torch.Tensor, key: str) -> torch.dtype | None:
        """ShardOptimizer: moments of bf16 parameters in ``bf16_states``; Kahan's compensation only
        with Kahan rounding (``COMPENSATION``), in the parameter's dtype."""
        low = param.dtype in LOW_MASTER_DTYPES
        if key == COMPENSATION:
            return param.dtype if low and self.rounding.buffers else None
        if key in ("exp_avg", "exp_avg_sq"):
            return self._moments_dtype(param)
        return param.dtype

    def _moments_dtype(self, param: torch.Tensor) -> torch.dtype:
        """Adam's moments of ``param``: ``bf16_states`` for a bf16 master, fp32 for an fp16 one
        (DeepSpeed's CPU Adam under fp16 masters), the parameter's own dtype otherwise."""
        if param.dtype == torch.bfloat16:
            return self.bf16_states
        return torch.float32 if param.dtype == torch.float16 else param.dtype

    def _key(self, param: torch.Tensor, step: int) -> int:
        """Stochastic rounding's key for ``param`` at ``step``: distinct per seed, step and
        parameter (its position in the groups), so no two draw the same bits."""
        position = next(
            i for i, p in enumerate(p for g in self.param_groups for p in g["params"]) if p is param
        )
        return (self.seed * 0x9E3779B1 + step * 0x85EBCA77 + position * 0xC2B2AE3D) & 0xFFFFFFFF

    @staticmethod
    def _run_closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _due(self):
        """(group, param, state, runs) for every parameter with a gradient: runs are (lo, hi, step number) over
        its flat elements, from ``step_runs`` or else the whole parameter at the count kept in ``state``."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self.state[param]
                if "step" not in state:
                    state["step"] = torch.tensor(
                        0.0
                    )  # a tensor, as torch keeps it (an int if loaded so)
                runs = self._runs.get(id(param))
                if runs is None:
                    runs = [(0, param.numel(), int(state["step"]) + 1)]
                elif not runs:
                    continue
                step = max(
                    s for _, _, s in runs
                )  # what state shows (the ZeRO step keeps the counts itself)
                if torch.is_tensor(state["step"]):
                    state["step"].fill_(step)
                else:
                    state["step"] = step
                yield group, param, state, runs

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        """``adam_step_``'s keyword arguments from a param group."""
        return dict(
            lr=float(group["lr"]),
            betas=tuple(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=group["adamw_mode"],
            bias_correction=group["bias_correction"],
        )


class DeepSpeedCPUAdam(CPUAdam):
    """``CPUAdam`` with DeepSpeed's ``DeepSpeedCPUAdam`` parameters in DeepSpeed's order
    (``model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
    fp32_optimizer_states``). AMSGrad is refused by name. ``fp32_optimizer_states=False`` keeps
    the moments of bf16 parameters in bf16, as DeepSpeed does (fp32 parameters: fp32 moments)."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdam(amsgrad=True): AMSGrad is not implemented (DeepSpeed refuses it too); "
                "use amsgrad=False, or torch.optim.AdamW(amsgrad=True)"
            )
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            fp32_optimizer_states=fp32_optimizer_states,
        )


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` (``deepspeed.ops.adam.FusedAdam``): torch's Adam, fused into one kernel
    where a group's parameters are all on a GPU (torch's ``fused=True``), else its multi-tensor path.
    Decided at each step from where the parameters are then: scripts build it before the model moves
    to the GPU, and the engine points it at its own (GPU or host) shards.
    ``adam_w_mode`` selects decoupled weight decay (AdamW). ``bias_correction=False`` and AMSGrad are
    refused by name; ``set_grad_none`` is torch's default already (``zero_grad`` sets None)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        if amsgrad:
            raise ValueError(
                "FusedAdam(amsgrad=True): not supported (DeepSpeed refuses it too); use amsgrad=False"
            )
        if not bias_correction:
            raise ValueError(
                "FusedAdam(bias_correction=False): torch's Adam always corrects the bias; use "
                "zengine.ops.CPUAdam(bias_correction=False) for CPU parameters"
            )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            on_gpu = bool(group["params"]) and all(
                p.is_cuda and p.is_floating_point() for p in group["params"]
            )
            group["fused"], group["foreach"] = (True, False) if on_gpu else (None, None)
        return super().step(closure)
