"""bf16 master weights and optimizer states on NVMe (issue 42 item 6): ``offload_optimizer: nvme``
with ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states`` at stage 2 (the moments in the
swap file) and stage 3 (ZeRO-Infinity: moments, master and gradient in the file, with and without
the parameters in their own file) steps the same bits as the same run with the optimizer offloaded
to the CPU, trains as torch AdamW on bf16 parameters does, resumes across NVMe and memory both ways,
and halves the swap file."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from harness import spawn
from models import (
    EdgeNet,
    edge_param_groups,
    make_batches,
    reference_run,
    train_global_batch,
    whole_states,
)

import zengine
from configs import PARITY_CLIP, PARITY_LR, PARITY_MICRO, parity_config
from zengine.estimate import estimate
from zengine.offload.state_swap import StateSwapper
from zengine.ops.aio import AsyncIO

MASTERS = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
STEPS, GAS = 4, 2


def _config(
    stage: int,
    offload,
    rounding: str = "nearest",
    low: bool = True,
    clip: bool = True,
    states: bool = True,
) -> dict:
    cfg = parity_config(stage, "bf16", GAS, dist.get_world_size(), offload)
    if not clip:
        cfg["gradient_clipping"] = 0.0
    if low:
        cfg["bf16"].update(MASTERS, master_rounding=rounding, bf16_optimizer_states=states)
    cfg["zero_optimization"]["sub_group_size"] = 1000  # the CPU runs chunk their steps alike
    return cfg


def _engine(stage: int, offload, rounding="nearest", low=True, clip=True, states=True):
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=_config(stage, offload, rounding, low, clip, states),
        model_parameters=edge_param_groups(model, PARITY_LR),
    )
    return engine


def _train(engine, steps: int, seed: int = 0) -> list[float]:
    batches = make_batches(steps, PARITY_MICRO * GAS * dist.get_world_size(), seed=seed)
    return [train_global_batch(engine, b, PARITY_MICRO, GAS) for b in batches]


def _params(engine) -> dict:
    with engine.summon_full_params(writeback=False):
        return {
            n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()
        }


def _run(stage: int, offload, rounding: str, clip: bool = True, states: bool = True) -> dict:
    engine = _engine(stage, offload, rounding, clip=clip, states=states)
    losses = _train(engine, STEPS)
    swapper = getattr(engine.optimizer.optimizer, "swapper", None)
    out = {
        "losses": losses,
        "params": _params(engine),
        "kind": type(engine.optimizer.optimizer).__name__,
    }
    if swapper is not None:
        out["record"] = [str(d) for d in swapper.dtypes]
        out["file"] = swapper.file.size
        out["padded"] = sum(c.padded for cs in swapper.chunks for c in cs)
        params = getattr(engine.optimizer, "param_swap", None)
        out["params_file"] = params.file.size if params is not None else 0
        out["swap_files"] = engine.memory_breakdown()["swap_files"]
    engine.destroy()
    return out


# (stage, offload on NVMe, the same with the optimizer on the CPU, rounding, clipping, worlds).
# Bit-equal needs the same shard layout wherever the sums or the bits depend on an element's place:
# ZeRO-Infinity aligns each parameter's shard to 2048 elements (O_DIRECT), as parameters on NVMe do,
# where the CPU optimizer with parameters in memory packs them. Stochastic rounding draws its bits
# by element index in the shard, and at W=3 gloo's ring adds the three bf16 gradients in an order
# set by the element's place in the bucket (each addition rounds; at W=2 the one addition does
# not depend on it): so the pairs of different layouts run at W=2 with nearest or Kahan rounding.
# ZeRO-Infinity also sums the norm's squares as the gradients are written, before the step's 1/W
# (which rounds in bf16 where W is not a power of two): the clip coefficient may differ in its last
# bits at W=3, so its pairs step unclipped; clipped, it is held to the torch reference below.
# (..., bf16 moments (False: fp32 moments over bf16 masters, a record of mixed dtypes), worlds)
PAIRS = [
    (2, "nvme", True, "stochastic", True, True, (2,)),  # SwappedAdam: bf16 moments in the file
    (2, "nvme", True, "kahan", True, True, (3,)),  # Kahan's compensation in memory with the master
    (3, "nvme", True, "kahan", True, True, (2,)),  # ZeRO-Infinity, params in memory; Kahan's part
    (3, "infinity", "param-nvme", "stochastic", False, True, (2, 3)),  # params in their file too
    (3, "infinity", "param-nvme", "kahan", False, True, (3,)),
    (3, "infinity", "param-nvme", "nearest", False, False, (2,)),  # [fp32 m | fp32 v | bf16 | bf16]
]


def _pairs() -> list:
    world = dist.get_world_size()
    out = []
    for stage, nvme, cpu, rounding, clip, states, worlds in PAIRS:
        if world in worlds:
            out.append(tuple(_run(stage, o, rounding, clip, states) for o in (nvme, cpu)))
    return out


def _reference_error(stage: int, offload: str) -> tuple[float, float]:
    """On NVMe against torch AdamW on bf16 parameters (bf16 moments), the same global batch,
    clipped: (parameter error relative to the reference's movement, movement, worst relative loss
    error)."""
    world = dist.get_world_size()
    mine = _run(stage, offload, "nearest")
    torch.manual_seed(0)
    init = EdgeNet().to(torch.bfloat16)
    batches = make_batches(STEPS, PARITY_MICRO * GAS * world, seed=0)
    ref_losses, ref_params = reference_run(copy.deepcopy(init), batches, PARITY_LR, PARITY_CLIP)
    start = {n: p.detach().float() for n, p in init.named_parameters()}
    moved = sum(((ref_params[n].float() - start[n]) ** 2).sum() for n in ref_params).sqrt()
    off = sum(
        ((torch.tensor(mine["params"][n]) - ref_params[n].float().reshape(-1)) ** 2).sum()
        for n in ref_params
    ).sqrt()
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(mine["losses"], ref_losses))
    return float(off / moved), float(moved), loss_err


@pytest.mark.parametrize("world", [2, 3])
def test_nvme_steps_the_same_bits_as_cpu_offload(world):
    """Moments (and at stage 3 masters and gradients) in bf16 records step with the in-memory
    path's arithmetic, rounding and stochastic keys: equal bits, loss for loss."""
    for pairs in spawn(_pairs, world):
        mine = [case for case in PAIRS if world in case[-1]]
        assert len(pairs) == len(mine) >= 3
        for case, (a, b) in zip(mine, pairs):
            stage, rounding, states = case[0], case[3], case[5]
            assert a["losses"] == b["losses"], case
            assert a["params"] == b["params"], case
            assert a["losses"][-1] < a["losses"][0], case  # it trains: the test could fail
            assert a["kind"] == ("SwappedAdam" if stage == 2 else "InfinityAdam"), a["kind"]
            moments = ["torch.bfloat16" if states else "torch.float32"] * 2
            rest = [] if stage == 2 else ["torch.bfloat16"] * (3 if rounding == "kahan" else 2)
            assert a["record"] == moments + rest, a["record"]
            per = 2 * len(rest) + (2 if states else 4) * 2  # bytes per element of a record
            assert a["file"] == per * a["padded"], case
            assert a["swap_files"] == a["file"] + a["params_file"] > 0, case  # memory_breakdown


@pytest.mark.parametrize("world,stage,offload", [(2, 2, "nvme"), (3, 3, "infinity")])
def test_nvme_matches_torch_adamw_on_bf16_parameters(world, stage, offload):
    # bounds of tests/zero/test_zero_bf16_masters.py's torch reference (measured 0.15-0.18)
    for off, moved, loss_err in spawn(_reference_error, world, stage, offload):
        assert moved > 0.2, moved
        assert off <= 0.25 and loss_err <= 0.03, (off, loss_err)


def test_bf16_records_take_half_the_bytes_of_fp32(tmp_path):
    sizes = [3 * 4096, 8192 + 4096]
    files = {}
    for dtype in (torch.float32, torch.bfloat16):
        for parts in (2, 4):
            s = StateSwapper(
                sizes, str(tmp_path), 4096, 2, AsyncIO(1 << 14, 1), dtypes=(dtype,) * parts
            )
            files[(dtype, parts)] = (s.file.size, s.bytes_per_element)
            s.close()
    assert files[(torch.float32, 2)] == (8 * sum(sizes), 8)  # SwappedAdam's fp32 moments
    assert files[(torch.bfloat16, 2)] == (4 * sum(sizes), 4)  # bf16 moments
    assert files[(torch.float32, 4)] == (16 * sum(sizes), 16)  # ZeRO-Infinity's fp32 record
    assert files[(torch.bfloat16, 4)] == (8 * sum(sizes), 8)  # [m | v | master | grad] in bf16


def test_the_estimate_counts_bf16_records():
    psi, world, chunk = 8_000_000, 4, 250_000
    nvme = {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 4}
    share = psi // world
    for stage, param, low, kahan, record in [
        (2, None, False, False, 8),  # fp32 moments
        (2, None, True, False, 4),  # bf16 moments
        (3, None, False, False, 16),  # ZeRO-Infinity's fp32 [m | v | master | grad]
        (3, nvme, True, False, 8),  # in bf16; the parameters' 2 bytes in their own file
        (3, None, True, True, 10),  # Kahan's compensation in the record
    ]:
        zero = {"stage": stage, "sub_group_size": chunk, "offload_optimizer": nvme}
        if param:
            zero["offload_param"] = param
        bf16 = {"enabled": True}
        if low:
            bf16.update(MASTERS, master_rounding="kahan" if kahan else "nearest")
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": bf16, "zero_optimization": zero}
        est = estimate(psi, cfg, world)
        case = (stage, bool(param), low, kahan)
        assert est.disk["optimizer swap file"] == record * share, case
        assert est.host["optimizer swap buffers"] == 4 * record * chunk, case
        assert est.disk.get("parameter swap file", 0) == (2 * share if param else 0), case
        assert "disk" in est.format(), case
        if stage == 3:  # masters and gradients in the file, none in memory
            assert "master weights" not in est.host and "gradients" not in est.host, case
        else:  # bf16 masters and gradients in host memory: 2 + 2 bytes (fp32: 4 + 4)
            per = 2 if low else 4
            assert est.host["master weights"] == est.host["gradients"] == per * share, case


def _resume(folder: str, stage: int, rounding: str, saving, loading: list) -> list:
    """Save after 2 steps with ``saving`` (offload, low); load into each of ``loading``: the values
    after the load, and the losses and parameters of 2 more steps."""
    engine = _engine(stage, saving[0], rounding, low=saving[1])
    _train(engine, 2, seed=1)
    engine.save_checkpoint(folder, tag="t")
    out = [whole_states(engine)]
    engine.destroy()
    for offload, low in loading:
        engine = _engine(stage, offload, rounding, low=low)
        engine.load_checkpoint(folder, tag="t")
        values = whole_states(engine)
        losses = _train(engine, 2, seed=2)
        out.append((values, losses, _params(engine)))
        engine.destroy()
    return out


def test_resume_across_nvme_and_memory(tmp_path):
    # stage 3, Kahan: ZeRO-Infinity bf16 -> CPU-offload bf16, ZeRO-Infinity bf16 (the compensation
    # read back into its record part: else the two would part), CPU-offload fp32 masters;
    # stage 2: CPU-offload bf16 -> NVMe bf16
    runs = [
        (3, "kahan", ("infinity", True), [("param-nvme", True), ("infinity", True), (True, False)]),
        (2, "nearest", (True, True), [("nvme", True)]),
    ]
    for k, (stage, rounding, saving, loading) in enumerate(runs):
        folder = str(tmp_path / f"ckpt{k}")
        for saved, *loaded in spawn(_resume, 2, folder, stage, rounding, saving, loading):
            for (offload, low), (values, losses, params) in zip(loading, loaded):
                assert values == saved, (stage, offload, low)  # bf16 widens to fp32 exactly
            same = [r for (o, low), r in zip(loading, loaded) if low]
            for values, losses, params in same[1:]:  # NVMe and memory go on with the same bits
                assert losses == same[0][1] and params == same[0][2], stage
