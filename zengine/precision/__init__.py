"""The compute precision: casting the model and its inputs (``cast.py``) and fp16 loss scaling
(``loss_scaler.py``)."""
from .cast import cast_floating, cast_module
from .loss_scaler import DynamicLossScaler, LossScaler, loss_carries_accumulation, make_loss_scaler

__all__ = ["DynamicLossScaler", "LossScaler", "cast_floating", "cast_module", "loss_carries_accumulation",
           "make_loss_scaler"]
