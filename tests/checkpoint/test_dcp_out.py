"""DCP out: zengine's ``save_checkpoint(..., checkpoint_format="dcp")`` (synchronous and in the background)
and ``zengine-convert to-dcp`` write what FSDP2 loads with ``dcp.load`` + ``set_state_dict``, and FSDP2's
next steps equal zengine's own continuation; zengine reads its DCP saves back at another stage."""

import os

import pytest
import torch

import dcp_runs as R
import zengine
from checkpoint_runs import LR, BufferedNet
from device_guard import caching_allocator_on_host
from harness import spawn
from models import edge_param_groups
from zengine.checkpoint.export import convert

TOL = 1e-5
# saving world size -> (stage, how) of each save in its one spawn; FSDP2 loads at another world size
SAVES = {
    1: [(1, "sync"), (3, "async")],
    2: [(2, "async"), (3, "convert"), (3, "partial"), (3, "cut")],
    3: [(2, "sync"), (3, "async")],
}
LOADER = {1: 2, 2: 3, 3: 1}


def make_engine(stage: int, seed: int, how: str):
    """``partial``: partial optimizer offload, whose sub-groups cut each param group in pieces and whose
    CPU Adam keeps fewer group keys than torch's AdamW; ``cut``: stage 3 as on a GPU, each param group
    cut into the gradient buckets (the unused layer's sub-group has no state: zeros are written)."""
    if how == "cut":
        with caching_allocator_on_host():
            engine = R.make_engine(stage, seed)
        assert len(engine.optimizer.groups) > engine.optimizer.group_map.count == 2
        return engine
    if how != "partial":
        return R.make_engine(stage, seed)
    cfg = R.zengine_config(stage)
    cfg["zero_optimization"].update(
        sub_group_size=300, offload_optimizer={"device": "cpu", "ratio": 0.5}
    )
    torch.manual_seed(seed)
    model = BufferedNet()
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    assert len(engine.optimizer.groups) > engine.optimizer.group_map.count == 2
    return engine


def zengine_saves(path: str, saves):
    """Each save: STOP steps, a save, its own continuation; a DCP save is reloaded at another stage."""
    out = []
    steps = R.batches_all()
    for i, (stage, how) in enumerate(saves):
        engine = make_engine(stage, 0, how)
        R.train_engine(engine, steps[: R.STOP])
        if how == "convert":  # zengine's own format: zengine-convert to-dcp in the parent
            engine.save_checkpoint(os.path.join(path, f"native{i}"))
        else:
            folder = os.path.join(path, f"save{i}")
            engine.save_checkpoint(folder, checkpoint_format="dcp", async_save=how == "async")
        losses = R.train_engine(engine, steps[R.STOP :])
        engine.destroy()  # waits for the save; two stage-3 engines are never alive together
        back = None
        if how != "convert":
            again = R.make_engine(1 if stage != 1 else 3, seed=2)
            again.load_checkpoint(folder)
            assert again.global_steps == R.STOP and again.micro_steps == R.STOP
            back = (R.train_engine(again, steps[R.STOP :]), R.engine_params(again))
            again.destroy()
        out.append((stage, losses, R.engine_params(engine), back))
    return out


def fsdp2_loads(folders: list[str]):
    out = []
    for folder in folders:
        model, opt = R.make_fsdp2(seed=1)
        R.load_fsdp2(folder, model, opt)
        out.append((R.train_fsdp2(model, opt, R.batches_all()[R.STOP :]), R.fsdp2_params(model)))
    return out


def gaps(a, b) -> tuple[float, float]:
    (la, pa), (lb, pb) = a, b
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(la, lb)), R.close(pa, pb)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_continues_zengine_dcp_save(tmp_path, world):
    path = str(tmp_path)
    saved = spawn(zengine_saves, world, path, SAVES[world])[0]
    folders = []
    for i, (stage, how) in enumerate(SAVES[world]):
        folder = os.path.join(path, f"save{i}", f"global_step{R.STOP}")
        if how == "convert":
            assert convert.main(["to-dcp", os.path.join(path, f"native{i}"), folder]) == 0
            assert convert.main(["to-dcp", os.path.join(path, f"native{i}"), folder]) == 1
        assert os.path.isfile(os.path.join(folder, ".metadata"))
        folders.append(folder)
    loaded = spawn(fsdp2_loads, LOADER[world], folders)[0]
    for (stage, losses, params, back), fsdp2, (_, how) in zip(saved, loaded, SAVES[world]):
        where = f"saved at W={world} stage {stage} ({how}), FSDP2 at W={LOADER[world]}"
        loss_gap, gap = gaps(fsdp2, (losses, params))
        assert loss_gap < TOL and gap < TOL, (where, loss_gap, gap)
        if back is not None:
            loss_gap, gap = gaps(back, (losses, params))
            assert loss_gap < TOL and gap < TOL, ("zengine reloads " + where, loss_gap, gap)
