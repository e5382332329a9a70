"""Stage-3 parameters used outside their own module's forward (#24 item 5): inside the engine's forward
they are gathered wherever an op receives them, also inside a list (``torch.cat`` of children's weights,
``torch.stack`` of an ``nn.ParameterList``), and train as in torch; used outside the forward (a regulariser
over ``engine.module.parameters()``), where they are empty tensors, they fail by name."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from configs import NO_PREFETCH, SHARD_ALL, adamw, ds_config
from harness import spawn
from models import train_beside_reference

DIM, STEPS, MICRO, LR = 12, 3, 2, 1e-2


class ConcatNet(nn.Module):
    """The root's forward concatenates its children's weights, and stacks a ParameterList."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.experts = nn.ParameterList([nn.Parameter(torch.randn(DIM) * 0.1) for _ in range(3)])
        self.out = nn.Linear(2 * DIM, 1)

    def forward(self, x, y):
        h = torch.tanh(
            F.linear(
                x, torch.cat([self.q.weight, self.k.weight]), torch.cat([self.q.bias, self.k.bias])
            )
        )
        scale = torch.stack(list(self.experts)).sum(0)  # [DIM]
        h = h * torch.cat([scale, scale])
        return F.mse_loss(self.out(h).squeeze(-1), y)


def _config():
    return ds_config(
        3,
        micro_batch=MICRO,
        gas=1,
        optimizer=adamw(LR, weight_decay=0.01),
        zero={**SHARD_ALL, **NO_PREFETCH},
    )


def _batches(world: int):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(MICRO * world, DIM, generator=g), torch.randn(MICRO * world, generator=g))
        for _ in range(STEPS)
    ]


def concat_training(model_cls=None) -> dict:
    torch.manual_seed(0)
    model = (model_cls or ConcatNet)()
    reference = copy.deepcopy(model)
    engine, *_ = zengine.initialize(model=model, config=_config())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    return train_beside_reference(
        engine, reference, ref_opt, _batches(dist.get_world_size()), MICRO
    )


def test_parameters_concatenated_and_stacked_in_forward_train_as_in_torch():
    for errors in spawn(concat_training, 2):
        assert max(errors.values()) < 1e-5, errors


class ViewNet(ConcatNet):
    """Views of other modules' weights in the root's forward: a slice of a position table (GPT code indexes
    ``wpe.weight[:T]`` rather than calling the module) and a transposed weight in a matmul. The views used to
    outlive the parameter's release and read freed storage (a segfault)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(8, DIM)

    def forward(self, x, y):
        h = x + self.pos.weight[:3].sum(0)  # a slice
        h = torch.tanh(
            h @ self.q.weight.t() + self.q.bias
        )  # a transposed view into a matmul (saved for backward)
        h = torch.cat([h, h * self.k.weight.t()[0]], dim=-1)  # a view of a view
        return F.mse_loss(self.out(h).squeeze(-1), y)


def test_views_of_parameters_in_forward_train_as_in_torch():
    for errors in spawn(concat_training, 2, ViewNet):
        assert max(errors.values()) < 1e-5, errors


def regulariser_outside_forward() -> str:
    torch.manual_seed(0)
    model = ConcatNet()
    engine, *_ = zengine.initialize(model=model, config=_config())
    x, y = _batches(dist.get_world_size())[0]
    loss = engine(x[:MICRO], y[:MICRO]) + 1e-3 * sum(
        p.pow(2).sum() for p in engine.module.parameters()
    )
    try:
        engine.backward(loss)
    except zengine.ExternalUseError as e:
        return str(e)
    return "no error"


def test_a_parameter_used_outside_forward_is_named():
    for message in spawn(regulariser_outside_forward, 2):
        assert "outside the engine's forward" in message, message
        names = [n for n, _ in ConcatNet().named_parameters()]
        assert any(f"({n}" in message or f" {n}" in message for n in names), (
            message
        )  # the parameter by name
