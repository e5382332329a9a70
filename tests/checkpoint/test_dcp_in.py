"""DCP in: a checkpoint FSDP2 wrote (PyTorch's tutorial layout, torchtitan's) loads into zengine at any
stage and world size, and the next steps equal FSDP2's own continuation, optimizer state included; a
corrupt or partial DCP folder is refused by name."""

import os
import shutil

import pytest
import torch

import dcp_runs as R
from harness import spawn
from zengine.checkpoint import CheckpointFileError, CheckpointNotFoundError
from zengine.checkpoint.dcp.boxes import flat_boxes, row_span

TOL = 1e-5


def fsdp2_saves(path: str):
    """FSDP2 at 2 ranks: STOP steps, both layouts saved, then its own continuation."""
    model, opt = R.make_fsdp2(0)
    steps = R.batches_all()
    R.train_fsdp2(model, opt, steps[: R.STOP])
    R.save_fsdp2(os.path.join(path, "tutorial"), "tutorial", model, opt, R.STOP)
    R.save_fsdp2(os.path.join(path, "torchtitan"), "torchtitan", model, opt, R.STOP)
    losses = R.train_fsdp2(model, opt, steps[R.STOP :])
    return losses, R.fsdp2_params(model)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp2"))
    losses, params = spawn(fsdp2_saves, 2, path)[0]
    return path, losses, params


def zengine_continues(path: str, runs):
    out = []
    for stage, layout, with_optimizer in runs:
        engine = R.make_engine(stage, seed=1)
        engine.load_checkpoint(os.path.join(path, layout), load_optimizer_states=with_optimizer)
        steps = engine.global_steps
        losses = R.train_engine(engine, R.batches_all()[R.STOP :])
        out.append((stage, layout, with_optimizer, steps, losses, R.engine_params(engine)))
        engine.destroy()
    return out


# one spawn per world size, covering stages 0-3 and both layouts between them
RUNS = {
    1: [(0, "tutorial", True), (1, "torchtitan", True), (3, "tutorial", True)],
    2: [(1, "tutorial", True), (2, "torchtitan", True), (3, "tutorial", False)],
    3: [(2, "tutorial", True), (3, "torchtitan", True)],
}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_checkpoint_continues_in_zengine(fsdp2_run, world):
    path, ref_losses, ref_params = fsdp2_run
    for stage, layout, with_opt, steps, losses, params in spawn(
        zengine_continues, world, path, RUNS[world]
    )[0]:
        where = f"W={world} stage {stage} {layout}"
        assert steps == R.STOP, where
        loss_gap = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
        gap = R.close(params, ref_params)
        if with_opt:
            assert loss_gap < TOL and gap < TOL, (where, loss_gap, gap)
        else:  # without Adam's moments the continuation differs: the state above was what made it equal
            assert gap > 1e-3, (where, gap)


def test_flat_ranges_and_boxes():
    """A flat range is the boxes it is made of, each a run of consecutive elements; rows cover it."""
    shape = (3, 4, 5)
    full = torch.arange(60).view(shape)
    for start, end in [(0, 60), (7, 53), (20, 40), (3, 4), (19, 21), (0, 1), (59, 60)]:
        got = []
        for box in flat_boxes(shape, start, end):
            part = full
            for dim, (o, s) in enumerate(zip(box.offsets, box.sizes)):
                part = part.narrow(dim, o, s)
            assert part.reshape(-1)[0].item() == box.flat_start
            got += part.reshape(-1).tolist()
        assert got == list(range(start, end)), (start, end)
    assert len(flat_boxes(shape, 7, 53)) <= 2 * len(shape) + 1
    assert flat_boxes((), 0, 1)[0].sizes == ()
    span = row_span(shape, 21, 41)
    assert span.offsets == (1, 0, 0) and span.sizes == (2, 4, 5) and span.flat_start == 20


def load_each(paths: list[str]):
    """(error class, message) of loading each folder into a stage-2 engine, None where it loaded."""
    out = []
    for path in paths:
        engine = R.make_engine(2, seed=1)
        try:
            engine.load_checkpoint(path)
            out.append(None)
        except Exception as e:
            out.append((type(e).__name__, str(e)))
        engine.destroy()
    return out


def damage(path: str, how: str) -> str:
    """Damage the DCP folder ``path``; returns the name of the file the error must name."""
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    if how == "no_metadata":  # a save killed before DCP wrote .metadata
        os.remove(os.path.join(path, ".metadata"))
        return ".metadata"
    if how == "missing_file":
        os.remove(os.path.join(path, data[-1]))
        return data[-1]
    if how == "truncated":
        with open(os.path.join(path, data[0]), "r+b") as f:
            f.truncate(100)
        return data[0]
    with open(os.path.join(path, ".metadata"), "wb") as f:  # not DCP's pickle
        f.write(b"\x80\x04not a pickle")
    return ".metadata"


def test_damaged_dcp_folder_is_named(fsdp2_run, tmp_path):
    """A partial or corrupt DCP folder raises CheckpointFileError naming the file, on every rank; a
    folder with neither DCP files nor zengine's 'latest' is still CheckpointNotFoundError."""
    paths, named = [], []
    for how in ("no_metadata", "missing_file", "truncated", "corrupt_metadata"):
        path = str(tmp_path / how)
        shutil.copytree(os.path.join(fsdp2_run[0], "tutorial"), path)
        named.append(damage(path, how))
        paths.append(path)
    (tmp_path / "empty").mkdir()
    for rank_results in spawn(load_each, 2, paths + [str(tmp_path / "empty")]):
        *damaged, empty = rank_results
        for (kind, message), name in zip(damaged, named):
            assert kind == CheckpointFileError.__name__, (kind, message)
            assert name in message, message
        assert empty[0] == CheckpointNotFoundError.__name__, empty


def test_sections_found_under_any_prefix():
    """The model, optimizer and train state are found from the keys alone, in each layout."""
    from zengine.checkpoint.dcp.sections import find_sections

    names, trained = ["a.weight", "a.bias", "b.weight", "scale"], ["a.weight", "a.bias", "b.weight"]
    tutorial = find_sections(
        ["app.model." + n for n in names]
        + [f"app.optim.state.{n}.{k}" for n in trained for k in ("exp_avg", "step")],
        ["app.optim.param_groups.0.lr", "app.optim.param_groups.0.params"],
        names,
        trained,
    )
    assert tutorial.model == {n: "app.model." + n for n in names}
    assert tutorial.optimizer == "app.optim."
    assert tutorial.state["b.weight"] == {
        "exp_avg": "app.optim.state.b.weight.exp_avg",
        "step": "app.optim.state.b.weight.step",
    }
    assert tutorial.group_lists() == ["app.optim.param_groups.0.params"]
    assert tutorial.nested_hyper_keys(0) == {"lr": "app.optim.param_groups.0.lr"}
    titan = find_sections(
        names
        + [f"optimizer.state.{n}.exp_avg" for n in trained]
        + ["train_state.step", "lr_scheduler.x"],
        [f"optimizer.param_groups.{n}.lr" for n in trained] + ["lr_scheduler.last_epoch"],
        names,
        trained,
    )
    assert titan.model == {n: n for n in names} and titan.optimizer == "optimizer."
    assert titan.group_lists() == []
    assert titan.hyper_keys(["a.bias"]) == {"lr": "optimizer.param_groups.a.bias.lr"}
    assert titan.under("lr_scheduler.") == {"last_epoch": "lr_scheduler.last_epoch"}
    assert find_sections(["x.y"], [], names, trained).model == {}
