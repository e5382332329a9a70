"""``PartialAdam``: one Adam over two shares of the flat master shards, each stepped where it lives.

Partial optimizer offload (``offload/partial.py``) keeps some sub-groups' masters and moments on the
compute device and the rest in host memory. DeepSpeed steps the host share with its CPU-Adam and the
device share with a second optimizer, torch's ``AdamW`` over the same param groups. Here one
optimizer holds both: its param groups and state are CPU-Adam's (``step``, ``exp_avg``,
``exp_avg_sq`` per flat parameter), so the state is the same logical Adam state whatever the split,
and a checkpoint taken at one ratio loads at any other. Parameters of the host share take CPU-Adam's
kernel; those of the device share take torch's own Adam (``torch.optim.adam.adam``, decoupled weight
decay as ``AdamW`` in ``adamw_mode``), run by run with each run's step number, as CPU-Adam does.
The two agree to float rounding (torch's Adam and the kernel order a few operations differently).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.optim.adam as torch_adam

from .adam import CPUAdam


class PartialAdam(CPUAdam):
    """CPU-Adam whose parameters in ``on_device`` are stepped by torch's Adam(W) instead (module
    doc). Like CPU-Adam it steps runs and pieces (``steps_in_pieces``): an offloaded step in pieces
    takes the device share's first (they land at once), queued on the device while CPU-Adam steps the
    host share's as they land."""

    def __init__(self, params, on_device: Iterable[torch.Tensor] = (), **defaults):
        super().__init__(params, **defaults)
        self.on_device = {id(p) for p in on_device}
        for group in self.param_groups:
            if not group["bias_correction"] and any(
                id(p) in self.on_device for p in group["params"]
            ):
                raise ValueError(
                    "partial offload: bias_correction=False cannot be stepped by torch's Adam on the "
                    "device share; leave bias_correction on, or offload every state (ratio 1.0)"
                )

    @classmethod
    def replacing(
        cls, optimizer: torch.optim.Optimizer, on_device: Iterable[torch.Tensor]
    ) -> "PartialAdam":
        """A ``PartialAdam`` over ``optimizer``'s param groups (the same dicts: an LR schedule built on
        ``optimizer`` still drives it). ``optimizer`` is CPU-Adam, or torch's Adam or AdamW (what the
        config's Adam becomes when some shards are not in host memory), whose groups take CPU-Adam's
        two keys from their own (``decoupled_weight_decay``); AMSGrad and maximize are refused."""
        if not isinstance(optimizer, (CPUAdam, torch.optim.Adam)):
            raise TypeError(f"PartialAdam replaces CPU-Adam or torch's Adam(W), not {optimizer!r}")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or isinstance(optimizer, CPUAdam)
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(
                        f"partial offload: {flag}=True is not CPU-Adam's; leave it off, or offload "
                        f"every state (ratio 1.0)"
                    )
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", decoupled))
            group.setdefault("bias_correction", True)
            for key in ("fused", "capturable"):  # torch's kernels choices: not taken here
                if group.get(key):
                    group[key] = None if key == "fused" else False
        keys = ("lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
        first = optimizer.param_groups[0] if optimizer.param_groups else optimizer.defaults
        defaults = {k: first[k] for k in keys if k in first}
        partial = cls(optimizer.param_groups, on_device=on_device, **defaults)
        for name in ("bf16_states", "rounding", "seed"):  # CPU-Adam's own settings, kept
            if hasattr(optimizer, name):
                setattr(partial, name, getattr(optimizer, name))
        return partial

    def _step(self, closure, copy_out_by_id: Mapping[int, torch.Tensor]):
        loss = self._run_closure(closure)
        due = list(self._due())
        # the device share first: its kernels are queued and run while CPU-Adam steps the host share
        due.sort(key=lambda d: id(d[1]) not in self.on_device)
        for group, param, state, runs in due:
            self._step_param(group, param, state, runs, copy_out_by_id.get(id(param)))
        return loss

    def _step_param(self, group: dict, param: torch.Tensor, state: dict, runs, out) -> None:
        if id(param) not in self.on_device:
            super()._step_param(group, param, state, runs, out)
            return
        if param.dtype != torch.float32:
            raise ValueError(
                f"partial offload: the device share steps fp32 masters with torch's Adam, got "
                f"{param.dtype}; keep fp32 masters, or offload every state (ratio 1.0)"
            )
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        for lo, hi, step in runs:
            views = [
                t.view(-1)[lo:hi]
                for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
            ]
            # torch counts the step up before using it: one below the run's step number
            torch_adam.adam(
                [views[0]],
                [views[1]],
                [views[2]],
                [views[3]],
                [],
                [torch.tensor(float(step - 1))],
                foreach=False,
                decoupled_weight_decay=bool(group["adamw_mode"]),
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=float(group["lr"]),
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            if out is not None:  # the compute-dtype parameters, on the device beside the master
                out.view(-1)[lo:hi].copy_(views[0])
