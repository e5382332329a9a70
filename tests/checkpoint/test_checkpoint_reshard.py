"""A checkpoint saved by W ranks at stage S continues at W' ranks and stage S' (offload too) with the numbers of a
run that never changed: checked against the single-process torch reference over the whole run."""

import pytest
import torch

from checkpoint_runs import (
    CLIP,
    LR,
    BufferedNet,
    as_lists,
    batches,
    config,
    full_params,
    make_engine,
    train,
)
from harness import spawn
from models import reference_run

STEPS, STOP = 6, 3


def save_after(path: str, stage: int) -> list:
    engine = make_engine(config(stage), seed=0)
    losses = train(engine, batches(STEPS)[:STOP])
    engine.save_checkpoint(path)
    return losses


def continue_from(path: str, targets) -> list:
    out = []
    for stage, offload in targets:
        engine = make_engine(config(stage, offload=offload), seed=1)
        engine.load_checkpoint(path)
        assert engine.global_steps == STOP
        losses = train(engine, batches(STEPS)[STOP:])
        out.append(
            {
                "losses": losses,
                "params": as_lists(full_params(engine)),
                "again": save_and_reload(engine, f"{path}-again") if stage == 3 else None,
            }
        )
    return out


def save_and_reload(engine, path: str) -> dict:
    """Saved at stage 3, loaded at stage 1 by the same ranks: the same parameters, and one more step
    agrees to float rounding (the optimizer states came along)."""
    engine.save_checkpoint(path)
    other = make_engine(config(1), seed=2)
    other.load_checkpoint(path)
    same = all(
        torch.equal(a, b) for a, b in zip(full_params(engine).values(), full_params(other).values())
    )
    extra = batches(STEPS + 1)[STEPS:]
    train(engine, extra)
    train(other, extra)
    after = max(
        (a - b).abs().max().item()
        for a, b in zip(full_params(engine).values(), full_params(other).values())
    )
    return {"same": same, "after_step": after}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reshard"))
    losses = spawn(save_after, 2, path, 1)[0]
    torch.manual_seed(0)
    ref_losses, ref_params = reference_run(BufferedNet(), batches(STEPS), LR, CLIP)
    assert losses == pytest.approx(ref_losses[:STOP], rel=1e-5)
    return path, ref_losses, ref_params


# (world, [(stage, optimizer offload)]): one process group per world size
# ("infinity": stage 3 with parameters and optimizer on NVMe; its "again" check saves from it and loads at stage 1)
@pytest.mark.parametrize(
    "world,targets",
    [
        (3, [(3, False), (2, True), (3, "nvme"), (3, "infinity")]),
        (1, [(0, False), (2, "nvme"), (3, "infinity")]),
    ],
)
def test_reshard_continues(saved, world, targets):
    path, ref_losses, ref_params = saved
    for (stage, offload), result in zip(targets, spawn(continue_from, world, path, targets)[0]):
        where = f"W=2 stage 1 -> W={world} stage {stage}{f' offload {offload}' if offload else ''}"
        assert result["losses"] == pytest.approx(ref_losses[STOP:], rel=1e-5), where
        worst = max(
            (torch.tensor(result["params"][n]) - p).abs().max().item()
            for n, p in ref_params.items()
        )
        assert worst <= 1e-5, f"{where}: max parameter error {worst:.3g}"
        if result["again"] is not None:
            assert result["again"]["same"], (
                f"{where}, saved again and loaded at stage 1: parameters differ"
            )
            assert result["again"]["after_step"] <= 1e-6, result["again"]
