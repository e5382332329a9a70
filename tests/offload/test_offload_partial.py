"""Partial optimizer offload (``offload_optimizer.ratio``, stage 3): DeepSpeed's sub-groups split between
the device (torch's Adam(W)) and the host (CPU-Adam), against the single-process torch AdamW reference.

One spawn per world size covers ratios 0.0, 0.3, 0.5 and 1.0 in fp32 (accumulation 2, clipping: the
global norm over both shares) and bf16, then a resume across ratios: a checkpoint saved at 0.3 loads at
0.7 and at 1.0 (and one saved at 1.0 at 0.5) and training goes on as if uninterrupted. On this CPU box the
device share lives in host memory too; which sub-groups are the device's is checked from the optimizer
(``PartialAdam.on_device``) against DeepSpeed's rule. fp32 agrees with torch to 1e-6 (CPU-Adam and
torch's Adam order a few float operations differently); bf16 within the parity suite's bf16 bounds.
"""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import zengine
from configs import PARITY_CLIP, PARITY_LR, PARITY_MICRO, parity_config
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, reference_run, train_global_batch
from zengine.offload.partial import host_share
from zengine.zero.sub_groups import split_sub_groups

STEPS, GAS, SUB_GROUP = 4, 2, 200  # 200 shard elements: several sub-groups per param group
RATIOS = (0.0, 0.3, 0.5, 1.0)


def _config(precision, ratio, gas=GAS):
    cfg = parity_config(3, precision, gas, dist.get_world_size(), offload="cpu")
    cfg["zero_optimization"]["sub_group_size"] = SUB_GROUP
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    return cfg


def _engine(model, precision, ratio):
    engine, *_ = zengine.initialize(
        model=model,
        config=_config(precision, ratio),
        model_parameters=edge_param_groups(model, PARITY_LR),
    )
    return engine


def _check_split(engine, ratio):
    """The device share is DeepSpeed's: the first int((1 - ratio) n) sub-groups; ratio 1.0 is today's path."""
    opt = engine.optimizer
    if ratio == 1.0:
        assert type(opt.optimizer).__name__ == "CPUAdam" and opt.group_map.count == len(opt.groups)
        return 0
    assert type(opt.optimizer).__name__ == "PartialAdam"
    n = len(opt.groups)
    assert n > 4 and opt.group_map.count == 2  # sub-groups of the two param groups
    on_device = [id(sp) in opt.optimizer.on_device for sp in opt.shard_params]
    assert on_device == [not h for h in host_share(n, ratio)]
    assert len(engine.get_lr()) == 2  # the user's param groups, not the sub-groups
    return sum(on_device)


def _params(engine):
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _off(params, ref_params, init):
    start = dict(init.named_parameters())
    moved = sum(((ref_params[n] - start[n].detach()) ** 2).sum() for n in ref_params).sqrt().item()
    off = sum(((params[n] - ref_params[n]) ** 2).sum() for n in ref_params).sqrt().item()
    worst = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    return worst, off / moved, moved


def ratio_parity(precision):
    """Each ratio trained STEPS steps against torch: (ratio, device sub-groups, worst error, off/moved)."""
    world = dist.get_world_size()
    out = []
    for ratio in RATIOS:
        torch.manual_seed(0)
        model = EdgeNet()
        init = copy.deepcopy(model)
        batches = make_batches(STEPS, PARITY_MICRO * GAS * world)
        engine = _engine(model, precision, ratio)
        on_device = _check_split(engine, ratio)
        losses, norms = [], []
        for batch in batches:
            losses.append(train_global_batch(engine, batch, PARITY_MICRO, GAS))
            norms.append(engine.get_global_grad_norm())
        params = _params(engine)
        ref_norms = []
        ref_losses, ref_params = reference_run(
            init, batches, PARITY_LR, PARITY_CLIP, norms=ref_norms
        )
        worst, rel, moved = _off(params, ref_params, init)
        assert moved > 0.1
        if precision == "fp32":
            assert worst <= 1e-6, (ratio, worst)
            assert norms == pytest.approx(ref_norms, rel=1e-6)
            assert max(norms) > PARITY_CLIP  # clipping ran, over both shares' norm
        else:
            assert rel <= 0.15, (ratio, rel)
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= 3e-2 * abs(b), (ratio, a, b)
        out.append((ratio, on_device, worst, rel))
        engine.destroy()
    return out


def resume_across_ratios(folder):
    """Save at one ratio, load at another, train on: equal to the reference of the whole run."""
    world = dist.get_world_size()
    out = []
    # (zengine's format, and DCP's: torch.distributed.checkpoint, its param groups the user's)
    for first, second, fmt in (
        (0.3, 0.7, None),
        (0.3, 1.0, None),
        (1.0, 0.5, None),
        (0.3, 1.0, "dcp"),
    ):
        torch.manual_seed(0)
        model = EdgeNet()
        init = copy.deepcopy(model)
        batches = make_batches(STEPS, PARITY_MICRO * GAS * world)
        engine = _engine(model, "fp32", first)
        for batch in batches[:2]:
            train_global_batch(engine, batch, PARITY_MICRO, GAS)
        tag = f"r{first}-{second}-{fmt}"
        engine.save_checkpoint(folder, tag=tag, **({"checkpoint_format": fmt} if fmt else {}))
        engine.destroy()
        torch.manual_seed(1)  # other initial values: the checkpoint must bring them all back
        engine = _engine(EdgeNet(), "fp32", second)
        engine.load_checkpoint(folder, tag=tag)
        for batch in batches[2:]:
            train_global_batch(engine, batch, PARITY_MICRO, GAS)
        params = _params(engine)
        _, ref_params = reference_run(init, batches, PARITY_LR, PARITY_CLIP)
        worst, rel, _ = _off(params, ref_params, init)
        assert worst <= 1e-6, (first, second, worst)
        out.append((first, second, worst))
        engine.destroy()
    return out


def _world_batches(worlds):
    """Two steps' global batches for each world size in turn (the global batch follows the ranks)."""
    out = []
    for i, w in enumerate(worlds):
        out += make_batches(2, PARITY_MICRO * GAS * w, seed=100 + i)
    return out


def save_at(folder, ratio, worlds):
    """The first two steps at this world size and ``ratio``, saved."""
    torch.manual_seed(0)
    engine = _engine(EdgeNet(), "fp32", ratio)
    for batch in _world_batches(worlds)[:2]:
        train_global_batch(engine, batch, PARITY_MICRO, GAS)
    engine.save_checkpoint(folder, tag="first")
    engine.destroy()


def load_at(folder, ratio, worlds):
    """Loaded at this world size and ``ratio``, two more steps: against the reference of all four."""
    torch.manual_seed(0)
    init = EdgeNet()
    engine = _engine(copy.deepcopy(init), "fp32", ratio)
    engine.load_checkpoint(folder, tag="first")
    batches = _world_batches(worlds)
    for batch in batches[2:]:
        train_global_batch(engine, batch, PARITY_MICRO, GAS)
    params = _params(engine)
    _, ref_params = reference_run(init, batches, PARITY_LR, PARITY_CLIP)
    worst, _, _ = _off(params, ref_params, init)
    assert worst <= 1e-6, worst
    engine.destroy()
    return worst


def test_partial_offload_checkpoint_reshards_across_world_sizes_and_ratios():
    with tempfile.TemporaryDirectory() as folder:
        spawn(save_at, 3, folder, 0.3, (3, 2))
        [worst, _] = spawn(load_at, 2, folder, 0.5, (3, 2))
    assert worst <= 1e-6


def client_optimizer_and_schedule():
    """The script's own torch AdamW and a per-group LambdaLR built on it: the sub-groups stay
    behind the user's two param groups (the schedule sets each group's lr in both shares)."""
    world = dist.get_world_size()
    lambdas = [lambda s: 1.0 / (s + 1), lambda s: 0.5**s]  # one per param group

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=PARITY_LR, betas=(0.9, 0.999), eps=1e-8)

    torch.manual_seed(0)
    model = EdgeNet()
    init = copy.deepcopy(model)
    client = adamw(edge_param_groups(model, PARITY_LR))
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambdas)
    cfg = _config("fp32", 0.5)
    del cfg["optimizer"]
    engine, *_ = zengine.initialize(
        model=model, config=cfg, optimizer=client, lr_scheduler=schedule
    )
    assert type(engine.optimizer.optimizer).__name__ == "PartialAdam"
    batches = make_batches(3, PARITY_MICRO * GAS * world)
    for batch in batches:
        train_global_batch(engine, batch, PARITY_MICRO, GAS)
    ref_lrs = []

    def ref_schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambdas)

    _, ref_params = reference_run(
        init, batches, PARITY_LR, PARITY_CLIP, make_optimizer=adamw, make_scheduler=ref_schedule
    )
    ref_lrs = [PARITY_LR * lambdas[0](3), 2 * PARITY_LR * lambdas[1](3)]
    assert engine.get_lr() == pytest.approx(ref_lrs)
    worst, _, _ = _off(_params(engine), ref_params, init)
    assert worst <= 1e-6, worst
    engine.destroy()
    return worst


CHECKPOINTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint"
)
DEEPSPEED_FIXTURE = os.path.join(
    os.path.dirname(CHECKPOINTS), "fixtures", "deepspeed", "s3_fp32_w2"
)


def from_deepspeed():
    """DeepSpeed 0.19.8's ZeRO-3 checkpoint (tests/fixtures/deepspeed) loads into a partial engine and
    trains on as DeepSpeed did (its recorded losses and masters, within the migration suite's 1e-6)."""
    import sys

    sys.path.insert(0, CHECKPOINTS)
    from deepspeed_runs import CONTINUED, SAVED_AT, TiedLM, batches, config, make_optimizer, train

    torch.manual_seed(1)
    model = TiedLM()
    cfg = config(3, "fp32", dist.get_world_size())
    cfg["zero_optimization"].update(
        sub_group_size=100, offload_optimizer={"device": "cpu", "ratio": 0.5}
    )
    engine, *_ = zengine.initialize(model=model, optimizer=make_optimizer(model), config=cfg)
    assert len(engine.optimizer.optimizer.on_device) > 0
    engine.load_checkpoint(DEEPSPEED_FIXTURE)
    losses = train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])
    ref = torch.load(os.path.join(DEEPSPEED_FIXTURE, "reference.pt"), weights_only=True)
    assert losses == pytest.approx(ref["losses_after"], rel=1e-6)
    worst = 0.0
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            got = zengine.utils.safe_get_full_fp32_param(p).detach().cpu().reshape(-1)
            worst = max(worst, (got - ref["after"][name].float().reshape(-1)).abs().max().item())
    assert worst <= 1e-6, worst
    engine.destroy()
    return worst


def partial_suite(folder):
    return (
        ratio_parity("fp32"),
        ratio_parity("bf16"),
        resume_across_ratios(folder),
        client_optimizer_and_schedule(),
        from_deepspeed() if dist.get_world_size() == 2 else None,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_partial_offload_matches_torch_at_every_ratio_and_resumes_across_ratios(world):
    with tempfile.TemporaryDirectory() as folder:
        results = spawn(partial_suite, world, os.path.join(folder, "ckpt"))
    fp32, bf16, resumed, client, deepspeed = results[0]
    # the device share grows as the ratio falls: all of it at 0.0, none at 1.0
    shares = [d for _, d, _, _ in fp32]
    assert shares[0] > shares[1] >= shares[2] > shares[3] == 0


def test_deepspeed_sub_group_rules():
    # DeepSpeed's _create_fp16_sub_groups: runs closed once they reach the size; one group when all fit
    assert split_sub_groups([100, 100, 50, 300, 10], 200) == [[0, 1], [2, 3], [4]]
    assert split_sub_groups([100, 100], 1000) == [[0, 1]]
    # stage3.py: sub-group i on the host when i >= int((1 - ratio) * n)
    assert host_share(4, 1.0) == [True] * 4 and host_share(4, 0.0) == [False] * 4
    assert host_share(10, 0.3) == [False] * 7 + [True] * 3
    assert host_share(1, 0.5) == [True]  # int(0.5) = 0: a single sub-group goes to the host
    assert host_share(3, 0.5) == [False, True, True]


def _zero(stage, device, ratio):
    from configs import ds_config

    section = {"device": device, "ratio": ratio}
    if device == "nvme":
        section["nvme_path"] = tempfile.gettempdir()
    return ds_config(stage, zero={"offload_optimizer": section})


def test_ratio_refused_where_deepspeed_refuses_it_and_ignored_with_a_warning_where_it_ignores_it():
    import warnings

    from zengine.config import ConfigError, load_config

    for stage in (1, 2):  # DeepSpeed 0.19.8: "Partial offloading only supported for ZeRO Stage 3."
        for device in ("cpu", "none"):
            with pytest.raises(ConfigError, match="offload_optimizer.ratio.*needs stage 3"):
                load_config(_zero(stage, device, 0.5), 1)
    # DeepSpeed splits nothing it swaps to NVMe: refused by name rather than half-done
    with pytest.raises(ConfigError, match="offload_optimizer.ratio.*device \"cpu\""):
        load_config(_zero(3, "nvme", 0.5), 1)
    with_params = _zero(3, "cpu", 0.5)
    with_params["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match="offload_optimizer.ratio.*offload_param"):
        load_config(with_params, 1)
    with pytest.warns(UserWarning, match="ratio 0.5 has no effect"):
        cfg = load_config(_zero(3, "none", 0.5), 1)
    assert not cfg.zero_optimization.offload_optimizer.partial
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(_zero(3, "cpu", 0.5), 1).zero_optimization.offload_optimizer.partial
        assert not load_config(_zero(2, "cpu", 1.0), 1).zero_optimization.offload_optimizer.partial
    with pytest.raises(ConfigError, match="ratio"):
        load_config(_zero(3, "cpu", 1.5), 1)
