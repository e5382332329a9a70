"""Stage 3: memory held in and out of forward, zero.Init, dynamic order, divergence, full parameters."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import stage3_config
from harness import spawn
from zengine import FetchOrderError
from zengine.zero.stage3.param import ParamState, lookup

DIM = 48


class Stack(nn.Module):
    def __init__(self, n=6, flip=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n))
        self.norm = nn.LayerNorm(DIM)  # small: persistent when the threshold allows
        self.flip = flip

    def forward(self, x):
        order = reversed(self.layers) if self.flip else self.layers
        for layer in order:
            x = torch.tanh(layer(x))
        return self.norm(x).pow(2).mean()


def held_bytes(module):
    return sum(p.untyped_storage().nbytes() for p in module.parameters())


def memory_run():
    torch.manual_seed(0)
    layer_numel = DIM * DIM  # biases and LayerNorm (<= DIM elements) stay whole
    engine, *_ = zengine.initialize(
        model=Stack(),
        config=stage3_config(
            stage3_max_live_parameters=2 * layer_numel,
            stage3_prefetch_bucket_size=layer_numel,
            stage3_param_persistence_threshold=DIM,
        ),
    )  # LayerNorm stays whole
    seen = []

    def probe(m, args):  # checked against the tensors' storage at every module entry
        live = sum(
            sp.full.untyped_storage().nbytes()
            for sp in engine.optimizer.all_sharded
            if not sp.persistent
        )
        seen.append((live, engine.optimizer.fetcher.held_numel * 4))

    for layer in engine.module.layers:
        layer.register_forward_pre_hook(probe)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, DIM)))
        engine.step()
    fetcher = engine.optimizer.fetcher
    sharded = [sp for sp in engine.optimizer.all_sharded if not sp.persistent]
    chunks = sum(sp.chunk for sp in sharded)
    persistent = sum(
        sp.numel for sp in engine.optimizer.all_sharded if sp.persistent
    )  # biases, LayerNorm
    assert persistent == 8 * DIM and len(sharded) == 6
    # outside forward: shards plus the persistent parameters, nothing else
    assert held_bytes(engine.module) == 4 * persistent
    persistent_chunks = sum(sp.chunk for sp in engine.optimizer.all_sharded if sp.persistent)
    persistent_full = sum(
        sp.full.numel() for sp in engine.optimizer.all_sharded if sp.persistent
    )  # padded
    assert engine.memory_breakdown()["parameters"] == 4 * (
        chunks + persistent_chunks + persistent_full
    )
    assert all(a == b for a, b in seen), seen
    assert max(a for a, _ in seen) <= 4 * 2 * layer_numel
    assert fetcher.peak_live_numel <= 2 * layer_numel
    return fetcher.peak_live_numel


def test_memory_in_and_out_of_forward():
    spawn(memory_run, 2)


def init_run():
    world = dist.get_world_size()
    peaks = []

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList()
            for _ in range(8):
                self.layers.append(nn.Linear(DIM, DIM))
                peaks.append(held_bytes(self))  # full storage alive while building

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).mean()

    with zengine.zero.Init():
        model = Big()
    total = 8 * (DIM * DIM + DIM)
    assert max(peaks) == 0, peaks  # each layer was partitioned as soon as it was built
    assert all(lookup(p).state is ParamState.SHARDED for p in model.parameters())
    shard_bytes = sum(lookup(p).shard.numel() * 4 for p in model.parameters())
    assert shard_bytes <= 4 * total / world + 4 * 16 * world
    with zengine.zero.GatheredParameters(model.layers[0].weight):
        w0 = model.layers[0].weight.detach().clone()
    engine, *_ = zengine.initialize(model=model, config=stage3_config())
    loss = engine(torch.ones(2, DIM))
    engine.backward(loss)
    engine.step()
    with engine.summon_full_params(writeback=False):
        moved = (engine.module.layers[0].weight - w0).abs().max().item()
    return w0.tolist(), moved


def test_zero_init_never_materializes_the_model():
    (w0, moved0), (w1, moved1) = spawn(init_run, 2)
    assert w0 == w1  # both ranks hold the same model
    assert 0 < moved0 == moved1


def dynamic_run(flip_from=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack(n=3)
    ref = copy.deepcopy(model)
    engine, *_ = zengine.initialize(
        model=model, config=stage3_config(stage3_prefetch_bucket_size=10**6)
    )
    opt = torch.optim.AdamW(
        ref.parameters(), lr=1e-2, weight_decay=0.0
    )  # DeepSpeed's AdamW default
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        x = torch.randn(4 * world, DIM, generator=g)
        engine.module.flip = ref.flip = step >= flip_from  # the module order changes
        engine.backward(engine(x[rank * 4 : (rank + 1) * 4]))
        engine.step()
        opt.zero_grad()
        ref(x).backward()
        opt.step()
    with engine.summon_full_params(writeback=False):
        return max(
            (p - q).abs().max().item() for p, q in zip(engine.module.parameters(), ref.parameters())
        )


def test_dynamic_module_order_trains_correctly():
    assert (
        max(spawn(dynamic_run, 2)) < 1e-4
    )  # same as with a fixed order (float rounding through Adam)


def divergent_run():
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(
        model=Stack(n=3), config=stage3_config(stage3_debug_fetch_order=True)
    )
    if dist.get_rank() == 1:
        engine.module.layers[1] = engine.module.layers[2]  # this rank skips a module
    try:
        engine.backward(engine(torch.randn(4, DIM)))
    except FetchOrderError as e:
        return str(e)
    return "no error"


def test_divergent_rank_raises_named_module_error():
    messages = spawn(divergent_run, 2, timeout=60)
    for m in messages:
        assert "ranks diverged" in m and "layers.1" in m and "layers.2" in m, m


def full_params_run():
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=Stack(n=2), config=stage3_config())
    w = engine.module.layers[0].weight
    with zengine.zero.GatheredParameters(w, modifier_rank=1):
        assert w.shape == (DIM, DIM)
        if rank == 1:
            w.data.fill_(0.25)
    with engine.summon_full_params(writeback=True):
        assert torch.all(w == 0.25)  # rank 1's write reached every rank's shard
        engine.module.layers[1].bias.data.fill_(-1.0)
    with engine.summon_full_params(rank0_only=True, writeback=False):
        sizes = [p.numel() for p in engine.module.parameters()]
    with torch.no_grad():  # evaluation forward, no backward
        engine.eval()
        loss_eval = engine(torch.ones(2, DIM)).item()
    with engine.summon_full_params(writeback=False):  # generation fast path: nothing moves inside
        loss_fast = engine(torch.ones(2, DIM)).item()
        bias = engine.module.layers[1].bias.detach().clone()
    assert w.numel() == 0  # released again outside
    return sizes, loss_eval, loss_fast, bias.tolist()


def grads_run():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack(n=2)
    ref = copy.deepcopy(model)
    engine, *_ = zengine.initialize(model=model, config=stage3_config())
    x = torch.randn(4 * world, DIM, generator=torch.Generator().manual_seed(3))
    engine.backward(engine(x[rank * 4 : (rank + 1) * 4]))
    ref(x).backward()
    with engine.summon_full_params(with_grads=True, writeback=False):
        worst = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(engine.module.parameters(), ref.parameters())
        )
    return worst


def test_summon_full_params_with_grads():
    assert max(spawn(grads_run, 3)) < 1e-6


def test_gathered_parameters_and_summon_full_params():
    (sizes0, e0, f0, b0), (sizes1, e1, f1, b1) = spawn(full_params_run, 2)
    assert all(s > 0 for s in sizes0) and all(s == 0 for s in sizes1)  # rank0_only
    assert e0 == e1 == f0 == f1
    assert set(b0) == set(b1) == {-1.0}  # writeback persisted into the shards


class Chain(nn.Module):
    """Linear layers regressing onto a fixed target: every weight gets a gradient well above rounding."""

    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x - 0.5).pow(2).mean()


def adopted_gradient_run(precision, adopt=True):
    """Stage 3 with one weight per gradient bucket, so that each weight's gradient is reduced in place
    (no bucket copy): two backward calls per micro-step, accumulation 2, against plain torch. With
    ``adopt=False`` every gradient is copied into a bucket buffer as before."""
    from zengine.zero.stage3.grads import RankMajor

    adopted = []
    original = RankMajor.adopt

    def counting(self, gi, bucket, sp, buffers):
        took = adopt and original(self, gi, bucket, sp, buffers)
        adopted.append(took)
        return took

    RankMajor.adopt = counting
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = Chain()
        ref = copy.deepcopy(model)
        cfg = stage3_config(reduce_bucket_size=DIM * DIM, overlap_comm=precision != "bf16")
        cfg.update(
            gradient_accumulation_steps=2,
            gradient_clipping=0.0,
            optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        )
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = zengine.initialize(model=model, config=cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            x = torch.randn(2, world, 4, DIM, generator=gen)  # [micro-step, rank, micro batch, DIM]
            for m in range(2):
                for _ in range(2):  # two backward calls before the step add up
                    engine.backward(engine(x[m, rank]))
                engine.step()
            ref_opt.zero_grad()
            (2 * ref(x.reshape(-1, DIM))).backward()
            ref_opt.step()
        with engine.summon_full_params(writeback=False):
            params = [p.detach().float().clone() for p in engine.module.parameters()]
    finally:
        RankMajor.adopt = original
    # as lists: tensors would go back through shared memory that the exiting worker takes with it
    return [p.tolist() for p in params], [p.tolist() for p in ref.parameters()], sum(adopted)


def _adopted_and_copied(precision):
    return adopted_gradient_run(precision), adopted_gradient_run(precision, False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradients_reduced_in_place_match_torch(precision):
    """A bucket of one unpadded weight reduces autograd's gradient itself: the same parameters, bit for
    bit, as copying it into a bucket buffer first, and (fp32) those of plain torch."""
    for world in (2, 3):
        both = spawn(_adopted_and_copied, world, precision)  # one process group for both runs
        runs, copied = [b[0] for b in both], [b[1] for b in both]
        torch.manual_seed(0)
        start = list(Chain().parameters())
        for (params, ref, adopted), (params_copied, _, none) in zip(runs, copied):
            params, ref, params_copied = (
                [torch.tensor(t) for t in ts] for ts in (params, ref, params_copied)
            )
            assert adopted >= 4 * 3 * 4 and none == 0, (
                f"W={world}: {adopted} gradients reduced in place"
            )
            assert all(torch.equal(a, b) for a, b in zip(params, params_copied)), (
                f"W={world}: results differ"
            )
            moved = max((p - q).abs().max().item() for p, q in zip(ref, start))
            assert moved > 1e-2
            if precision == "fp32":
                worst = max((p - q).abs().max().item() for p, q in zip(params, ref))
                assert worst < 1e-5, f"W={world}: off plain torch by {worst:.3g}"
