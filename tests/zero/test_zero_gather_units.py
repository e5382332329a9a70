"""Stage 3's gather groups (``stage3_gather_units``): at DeepSpeed's defaults, without leaf modules,
consecutive modules of one block travel as one collective; values equal gathering module by module
and plain torch; leaf modules and the 'module' choice are honoured."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import stage3_config
from harness import spawn
from zengine.models import GPT, GPTConfig
from zengine.zero.stage3.blocks import BlockOf, block_names
from zengine.zero.stage3.param import ParamState
from zengine.zero.stage3.trace import gather_groups

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)
MICRO, STEPS, LR = 2, 4, 1e-3
BLOCK = 12 * CFG.d_model**2 + 9 * CFG.d_model  # a block's sharded elements (matrices, two biases)


# -- finding blocks and forming groups (no processes) -------------------------------------------
def test_blocks_are_the_stacked_layers_or_the_declared_classes():
    assert block_names(GPT(CFG)) == ["blocks.0", "blocks.1", "blocks.2"]

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    class Declared(nn.Module):  # as a transformers model: the block class named, not stacked
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.first, self.second = Layer(), Layer()
            self.out = nn.Linear(4, 4)

    assert block_names(Declared()) == ["first", "second"]
    mixed = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # not one class: no blocks
    assert block_names(mixed) == []
    assert BlockOf(["layers.1", "layers.10"])("layers.10.fc (backward)") == "layers.10"
    assert BlockOf(["layers.1"])("head") is None


def _unit(tag, *numels, dtype=torch.float32):
    params = [
        SimpleNamespace(
            numel=n, persistent=n < 10, state=ParamState.SHARDED, full=torch.empty(0, dtype=dtype)
        )
        for n in numels
    ]
    return ((tag, tuple(id(p) for p in params)), params)


def test_groups_stay_in_a_block_under_the_cap_and_of_one_dtype():
    units = [
        _unit("emb", 100),
        _unit("pos", 50),
        _unit("b.0.q", 40),
        _unit("b.0.norm", 4),  # persistent only: joins its neighbours
        _unit("b.0.o", 40),
        _unit("b.0.up", 40),
        _unit("b.1.q", 40),
        _unit("b.1.o", 40, dtype=torch.bfloat16),
        _unit("head (backward)", 100),
    ]
    block_of = BlockOf(["b.0", "b.1"])
    # cap 100: emb+pos would be 150 -> apart; b.0 is 120 -> split after two linears
    assert gather_groups(units, 100, block_of) == [1, 2, 5, 5, 5, 6, 7, 8, 9]
    assert gather_groups(units, 1000, block_of) == [2, 2, 6, 6, 6, 6, 7, 8, 9]
    assert gather_groups(units, 0, block_of) == list(range(1, 10))  # 'module' / prefetch off


# -- trained on gloo ranks ---------------------------------------------------------------------
def _batches():
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, CFG.vocab_size, (4 * MICRO, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (4 * MICRO, CFG.seq_len), generator=g),
        )
        for _ in range(STEPS)
    ]


def _train(units: str, reuse: int, leaf: bool) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model)
    if leaf:
        zengine.utils.set_z3_leaf_modules(model, ["MLP"])
    config = stage3_config(
        stage3_param_persistence_threshold=64,  # the matrices are sharded, norms and biases whole
        stage3_max_reuse_distance=reuse,  # 0: the backward gathers again
        stage3_prefetch_bucket_size=BLOCK,  # a block's worth ahead, as FSDP2 prefetches one unit
        # the bucket "auto" reduces in (units.py), for 'module' too: the same sums in the same order
        reduce_bucket_size=BLOCK,
        stage3_gather_units=units,
    )
    config.update(
        train_micro_batch_size_per_gpu=MICRO,
        gradient_accumulation_steps=1,
        optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    )
    engine, *_ = zengine.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    check = engine.optimizer.fetcher.check
    gathers, losses = [], []
    for x, y in _batches():
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        before = check.issued_count
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        gathers.append(check.issued_count - before)  # (the boundary step resets the count)
        engine.step()
        losses.append(loss.item())
    with engine.summon_full_params(writeback=False):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    # plain torch on the same global batch (world * MICRO rows of each batch)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for x, y in _batches():
        opt.zero_grad()
        reference(x[: world * MICRO], y[: world * MICRO]).backward()
        opt.step()
    diff = max(
        (weights[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
    )
    # (arrays pickle by value; a tensor would travel as a handle to this process's memory)
    return {"gathers": gathers, "weights": {n: w.numpy() for n, w in weights.items()}, "diff": diff}


@pytest.mark.parametrize("world", [2, 3])
def test_auto_units_gather_per_block_with_the_values_of_module_units(world):
    auto = spawn(_train, world, "auto", 0, False)
    module = spawn(_train, world, "module", 0, False)
    for r in range(world):
        assert auto[r]["diff"] < 1e-5 and module[r]["diff"] < 1e-5, (
            auto[r]["diff"],
            module[r]["diff"],
        )
        for n, w in module[r]["weights"].items():
            assert (auto[r]["weights"][n] == w).all(), n
    # after the first (recording) step, one collective per group: the forward gathers the
    # embeddings, each block (qkv, out, up, down together) and the tied head; the backward (reuse
    # distance 0) gathers them again in reverse
    steady_auto, steady_module = auto[0]["gathers"][1:], module[0]["gathers"][1:]
    assert steady_auto == [2 * (CFG.n_layer + 2)] * (STEPS - 1), steady_auto
    assert all(m >= 4 * 2 * CFG.n_layer for m in steady_module), steady_module


def test_leaf_modules_are_honoured_inside_groups():
    leaf = spawn(_train, 2, "auto", 10**9, True)
    plain = spawn(_train, 2, "auto", 10**9, False)
    for r in range(2):
        assert leaf[r]["diff"] < 1e-5
        for n, w in plain[r]["weights"].items():
            assert (leaf[r]["weights"][n] == w).all(), n
    # DeepSpeed's reuse distance 1e9: with 'module' units the backward gathers nothing again (the
    # forward: one gather per module); 'auto' keeps a used parameter only within the prefetch window
    # (units.py), as FSDP2 reshards after forward: the backward gathers the earlier blocks again,
    # one group each, fewer than with reuse distance 0 (2 * (n_layer + 2), above)
    module = spawn(_train, 2, "module", 10**9, False)
    assert leaf[0]["gathers"][1:] == plain[0]["gathers"][1:] == [9] * (STEPS - 1)
    # (the forward's: the embeddings, the four matrices of each block, the tied head)
    assert module[0]["gathers"][1:] == [4 * CFG.n_layer + 2] * (STEPS - 1)
    assert not any((module[0]["weights"][n] != w).any() for n, w in plain[0]["weights"].items())
