"""The compute precision: casting the model and its inputs (``cast.py``), fp16 loss scaling
(``loss_scaler.py``) and the gradient factor the step divides out (``grad_factor.py``)."""

from .cast import cast_floating, cast_module
from .grad_factor import GradFactor
from .loss_scaler import DynamicLossScaler, LossScaler, loss_carries_accumulation, make_loss_scaler

__all__ = [
    "DynamicLossScaler",
    "GradFactor",
    "LossScaler",
    "cast_floating",
    "cast_module",
    "loss_carries_accumulation",
    "make_loss_scaler",
]
