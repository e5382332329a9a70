"""Every gradient counts once, whatever path it took to its parameter (#24 item 2): the division by
gradient_accumulation_steps is the step's, not the loss's. Against the single-process torch reference
on the global batch, at gas 1 and 2, fp32, bf16 and fp16 (a loss scale undone once), with ``engine.backward`` and a plain
``loss.backward()``: a model returning ``(loss, logits)`` whose loss is built from its logits; a dict
output; two engines chained (the encoder engine's output feeds the decoder engine); a penalty computed
outside the forward from ``engine.module.parameters()``; an engine called twice per micro-step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from configs import ds_config, sgd
from harness import spawn

DIM, STEPS, MICRO, LR, PENALTY = (
    8,
    3,
    2,
    0.1,
    1e-1,
)  # plain SGD: an update shows any error in a gradient's scale


class Net(nn.Module):
    def __init__(self, returns: str = "loss"):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 16)
        self.fc2 = nn.Linear(16, DIM)
        self.returns = returns

    def forward(self, x, y=None):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        if y is None:
            return logits
        loss = F.mse_loss(logits, y)
        if self.returns == "tuple":
            return loss, logits
        if self.returns == "dict":
            return {"loss": loss, "logits": logits}
        return loss


def _config(gas: int, precision: str):
    # fp16: dynamic loss scaling, the scale must be undone once, whatever the path
    return ds_config(
        2,
        precision,
        micro_batch=MICRO,
        gas=gas,
        optimizer=sgd(LR),
        zero={"reduce_bucket_size": 100},
        **({"fp16": {"initial_scale_power": 12}} if precision == "fp16" else {}),
    )


def _loss(pattern, engines, x, y):
    """The loss of one micro-batch through the engines (or through the reference modules)."""
    first = engines[0]
    if pattern == "tuple":
        loss, logits = first(x, y)
        return loss + 0.1 * logits.pow(2).mean()  # the logits reach the parameters a second way
    if pattern == "dict":
        out = first(x, y)
        return out["loss"] + 0.1 * out["logits"].pow(2).mean()
    if pattern == "chained":
        return F.mse_loss(engines[1](first(x)), y)
    if pattern == "penalty":
        module = first.module if hasattr(first, "module") else first
        return first(x, y) + PENALTY * sum(p.pow(2).sum() for p in module.parameters())
    if pattern == "twice":
        return first(x, y) + first(x * 0.5, y)
    raise ValueError(pattern)


def grad_paths(pattern: str, gas: int, precision: str, plain: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    returns = pattern if pattern in ("tuple", "dict") else "loss"
    models = [Net(returns)] + ([Net()] if pattern == "chained" else [])
    references = copy.deepcopy(models)
    engines = [zengine.initialize(model=m, config=_config(gas, precision))[0] for m in models]
    ref_opt = torch.optim.SGD([p for m in references for p in m.parameters()], lr=LR)
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        x = torch.randn(gas * world * MICRO, DIM, generator=g)
        y = torch.randn(gas * world * MICRO, DIM, generator=g)
        for m in range(gas):
            lo = (m * world + rank) * MICRO
            loss = _loss(pattern, engines, x[lo : lo + MICRO], y[lo : lo + MICRO])
            if plain:
                loss.backward()
            else:
                engines[-1].backward(loss)  # (a chained encoder's bracket opens at its outputs)
            for e in engines:
                e.step()
        ref_opt.zero_grad()
        total = sum(
            _loss(
                pattern, references, x[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO]
            )
            for k in range(gas * world)
        ) / (gas * world)
        total.backward()
        ref_opt.step()
    out = {}
    for i, (m, r) in enumerate(zip(models, references)):
        for (n, p), (_, q) in zip(m.named_parameters(), r.named_parameters()):
            out[f"{i}.{n}"] = (p.detach().float() - q.detach()).abs().max().item()
    return out


TOLERANCE = {
    "fp32": 1e-5,
    "bf16": 3e-2,
    "fp16": 4e-3,
}  # 16-bit: the parameters' own rounding over a few steps


@pytest.mark.parametrize("pattern", ["tuple", "dict", "chained", "penalty", "twice"])
@pytest.mark.parametrize(
    "gas,precision,plain",
    [
        (2, "fp32", True),
        (2, "fp32", False),
        (1, "bf16", True),
        (2, "bf16", False),
        (2, "fp16", True),
        (1, "fp16", False),
    ],
)
def test_every_gradient_counts_once(pattern, gas, precision, plain):
    for errors in spawn(grad_paths, 2, pattern, gas, precision, plain):
        assert max(errors.values()) < TOLERANCE[precision], errors


def mixed_window() -> str:
    torch.manual_seed(0)
    engine = zengine.initialize(model=Net(), config=_config(2, "fp16"))[0]
    x, y = torch.randn(MICRO, DIM), torch.randn(MICRO, DIM)
    engine.backward(engine(x, y))  # the loss times the loss scale over the accumulation steps
    engine.step()
    engine(x, y).backward()  # a plain backward: nothing to scale
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_fp16_window_mixing_scaled_and_plain_backward_is_refused():
    """Their gradients carry different factors, so no one factor turns their sum into the gradient."""
    message = spawn(mixed_window, 1)[0]
    assert "carried different factors" in message and "engine.backward(loss)" in message, message
