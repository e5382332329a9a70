"""The gradient factor (zengine/precision/grad_factor.py) without a process group: what a loss is
multiplied by, what the step divides the summed gradients by, and the pass running across engines."""

from types import SimpleNamespace

import pytest

from zengine.precision.grad_factor import GradFactor
from zengine.precision.loss_scaler import LossScaler


def _factor(fp16: bool, scale: float = 1.0, gas: int = 4, world: int = 2) -> GradFactor:
    return GradFactor.for_precision(LossScaler(scale), SimpleNamespace(enabled=fp16), gas, world)


def test_fp32_divides_the_accumulation_steps_at_the_step_once():
    factor = _factor(fp16=False)
    assert factor.loss_factor() == 1.0  # the loss is left as it is
    assert factor.unscale() == 1.0 / (2 * 4)  # world x accumulation steps, at the step


def test_fp16_divides_each_loss_and_the_step_removes_the_scale():
    factor = _factor(fp16=True, scale=1024.0)
    assert factor.loss_factor() == 1024.0 / 4
    assert factor.unscale() == 1.0 / (2 * 1024.0)  # the accumulation steps were divided in the loss


def test_the_window_multiplier_is_what_the_passes_carried():
    factor = _factor(fp16=True, scale=1024.0)
    factor.window_carries(1.0)  # a plain fp16 loss.backward(): no scale reached the gradients
    assert factor.unscale() == 1.0 / (2 * 1.0 * 4)
    factor.window_carries(None)  # a new window: back to the configured factor
    assert factor.unscale() == 1.0 / (2 * 1024.0)


def test_changed_accumulation_steps_reach_loss_and_step():
    fp16, bf16 = _factor(fp16=True, scale=8.0), _factor(fp16=False)
    fp16.accumulation_steps = bf16.accumulation_steps = 2  # engine.set_train_batch_size
    assert fp16.loss_factor() == 4.0
    assert bf16.unscale() == 1.0 / (2 * 2)
    assert fp16.divided_loss_carries() == 4.0  # scale_wrt_gas=False: the caller divided already


@pytest.mark.parametrize("outer, inner", [(2.0, 0.5), (1.0, 3.0)])
def test_the_running_pass_nests_and_restores(outer, inner):
    assert GradFactor.of_running_pass() is None  # a plain loss.backward()
    with GradFactor.running_pass(outer):
        with GradFactor.running_pass(inner):  # an engine's backward inside another's
            assert GradFactor.of_running_pass() == inner
        assert GradFactor.of_running_pass() == outer
    assert GradFactor.of_running_pass() is None
