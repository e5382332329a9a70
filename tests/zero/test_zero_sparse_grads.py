"""Sparse embeddings (``nn.Embedding(sparse=True)``) train at every stage as in plain torch (issue 41
case 10): the gradient hooks make a sparse gradient dense before the store takes it (stages 2-3 crashed
at the first backward: ``reshape is not implemented for sparse tensors``). SGD with momentum and
Adagrad, 2 ranks, gradient_accumulation_steps 2, against a single-process torch run on the global batch
with the same sparse embedding."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn

VOCAB, DIM, MICRO, GAS, STEPS = 12, 4, 3, 2, 3


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Bag()


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.Adagrad(params, lr=0.2)


def _batches(world: int = 2) -> list:
    g = torch.Generator().manual_seed(1)
    # tokens 0..VOCAB/2 only: the other rows get no gradient, as a sparse update skips them
    return [
        [
            (
                torch.randint(0, VOCAB // 2, (world * MICRO, 3), generator=g),
                torch.randn(world * MICRO, 1, generator=g),
            )
            for _ in range(GAS)
        ]
        for _ in range(STEPS)
    ]


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def _reference(name: str) -> torch.Tensor:
    model = _model()
    opt = _optimizer(name, model.parameters())
    for micro_batches in _batches():
        for x, y in micro_batches:
            (nn.functional.mse_loss(model(x), y) / GAS).backward()
        opt.step()
        opt.zero_grad()
    return _flat(model)


def _train(stage: int) -> dict:
    out = {}
    for name in ("sgd", "adagrad"):
        model = _model()
        cfg = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zengine.initialize(
            model=model, optimizer=_optimizer(name, model.parameters()), config=cfg
        )
        rows = slice(dist.get_rank() * MICRO, (dist.get_rank() + 1) * MICRO)
        for micro_batches in _batches():
            for x, y in micro_batches:
                engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
                engine.step()
        with engine.summon_full_params(writeback=False):
            out[name] = _flat(engine.module).tolist()
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sparse_embedding_trains_as_torch(stage):
    for runs in spawn(_train, 2, stage):
        for name, weights in runs.items():
            expected = _reference(name)
            assert (torch.tensor(weights) - expected).abs().max() < 1e-5, (stage, name)
            assert (expected - _flat(_model())).abs().max() > 1e-2  # it trained
