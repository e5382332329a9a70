"""Test models and the single-process torch reference they are checked against."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 23, 41, 5


class EdgeNet(nn.Module):
    """Tied embedding/head, a frozen layer, an unused layer, odd sizes no world size divides, a module
    called twice per forward, and a parameter used outside its module (``F.linear`` on ``emb.weight``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.unused = nn.Linear(DIM, 7)
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x, y):
        h = self.emb(x)
        h = torch.relu(self.fc1(h))
        h = torch.tanh(self.frozen(h))
        h = self.norm(self.fc2(h))
        h = h + self.mix(torch.tanh(self.mix(h)))  # the same module twice
        logits = self.head(h) + 0.5 * F.linear(
            h, self.emb.weight
        )  # a parameter used outside its module
        return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))


def edge_param_groups(model: nn.Module, lr: float) -> list[dict]:
    """Two groups with their own hyper-parameters: matrices with decay, vectors without and a larger lr."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2},
    ]


def make_batches(steps: int, global_batch: int, seed: int = 1234):
    """Deterministic token batches: a list of (x, y) of shape [global_batch, SEQ]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
        out.append((x, (x * 7 + 3) % VOCAB))
    return out


def micro_batch(batch, rank: int, world: int, micro: int, m: int):
    """Rank ``rank``'s ``m``-th micro-batch of a global batch."""
    x, y = batch
    lo = (m * world + rank) * micro
    return x[lo : lo + micro], y[lo : lo + micro]


def train_global_batch(engine, batch, micro: int, gas: int, device=None) -> float:
    """One global batch through ``engine``: ``gas`` micro-steps of ``micro`` samples per rank (forward,
    ``engine.backward``, ``engine.step``). Returns the mean loss over ranks and micro-steps (a collective;
    the losses are summed on ``device``, read once)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros((), device=device)
    for m in range(gas):
        x, y = micro_batch(batch, rank, world, micro, m)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / (world * gas)


def reference_run(
    model: nn.Module,
    batches,
    lr: float,
    clip: float,
    make_optimizer=None,
    make_scheduler=None,
    norms: list = None,
):
    """Plain torch on the global batch: AdamW (or ``make_optimizer(groups)``), clipping by the global
    norm, an optional scheduler. Returns (losses, params by name); appends each step's norm to ``norms``."""
    model = copy.deepcopy(model)
    groups = edge_param_groups(model, lr)
    opt = (
        make_optimizer(groups)
        if make_optimizer
        else torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    )
    sched = make_scheduler(opt) if make_scheduler else None
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        with_grad = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(with_grad, clip if clip > 0 else float("inf"))
        if norms is not None:
            norms.append(norm.item())
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_beside_reference(
    engine, reference: nn.Module, ref_opt, batches, micro: int, before_each=lambda: None
) -> dict[str, float]:
    """Each global batch ``(x, y)`` through ``engine`` (this rank's ``micro`` rows, one step per batch, after
    ``before_each()``) and through the single-process ``reference`` (the whole batch); returns each parameter's
    largest difference between the two afterwards (the engine's gathered whole)."""
    rank = dist.get_rank()
    for x, y in batches:
        before_each()
        mine = slice(rank * micro, (rank + 1) * micro)
        engine.backward(engine(x[mine], y[mine]))
        engine.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
    with engine.summon_full_params(writeback=False):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        n: (got[n].float() - p.detach()).abs().max().item() for n, p in reference.named_parameters()
    }


def whole_states(engine) -> dict[str, list[float]]:
    """Every trained parameter of an engine over ``EdgeNet``: its master (``master/<name>``), Adam moments
    (``exp_avg/<name>``, ``exp_avg_sq/<name>``) and compute-dtype value (``param/<name>``), whole, as
    lists of floats (tensors would leave a rank through file descriptors that close with it). The unused
    layer has no optimizer state: its parameters count as values only."""
    from zengine.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad or name.startswith("unused."):
            continue
        out[f"master/{name}"] = safe_get_full_fp32_param(p).float()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).float()
    with engine.summon_full_params(writeback=False):
        for name, p in engine.module.named_parameters():
            out[f"param/{name}"] = p.detach().float().clone()
    return {k: v.reshape(-1).tolist() for k, v in out.items()}


def train_edge_engine(config: dict, steps: int, gas: int, lr: float):
    """``EdgeNet`` (seed 0) trained by an engine of ``config`` over ``steps`` global batches, ``gas``
    micro-steps each: (losses, whole parameters in fp32, the initial model, the batches, what the
    optimizer keeps: the dtypes of its states and masters, its class, the skipped steps)."""
    import zengine

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    init = copy.deepcopy(model)
    batches = make_batches(steps, config["train_micro_batch_size_per_gpu"] * gas * world)
    engine, *_ = zengine.initialize(
        model=model, config=config, model_parameters=edge_param_groups(model, lr)
    )
    losses = [
        train_global_batch(engine, b, config["train_micro_batch_size_per_gpu"], gas)
        for b in batches
    ]
    opt = engine.optimizer
    kinds = {
        "states": sorted(
            {str(t.dtype) for s in opt.optimizer.state.values() for t in s.values() if t.dim()}
        ),
        "masters": sorted({str(m.dtype) for m in opt.masters}),
        "class": type(opt.optimizer).__name__,
        "skipped": engine.skipped_steps,
    }
    with engine.summon_full_params(writeback=False):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return losses, params, init, batches, kinds
