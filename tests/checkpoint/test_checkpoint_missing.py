"""A load that finds no checkpoint raises on every rank unless ``missing_ok=True`` (then ``(None, None)``), and
``missing_ok`` never hides a damaged one; meta.json checks itself; a save removes what killed saves left.

One spawn (2 ranks) runs every case and records what each call returned or raised; the tests check the record.
"""

import json
import os
import shutil

import pytest
import torch.distributed as dist

from checkpoint_runs import batches, config, make_engine, train
from harness import spawn
from zengine.checkpoint import (
    CheckpointFileError,
    CheckpointNotFoundError,
    get_fp32_state_dict_from_zero_checkpoint,
)
from zengine.checkpoint.native import atomic, meta as meta_mod


def _outcome(fn, *args, **kwargs) -> tuple:
    """``("returned", value)`` or ``("raised", exception type name, message)``; never raises."""
    try:
        return ("returned", fn(*args, **kwargs))
    except Exception as e:
        return ("raised", type(e).__name__, str(e))


def _on_rank0(fn, *args) -> None:
    if dist.get_rank() == 0:
        fn(*args)
    dist.barrier()


def _write_latest(ckpt: str, text: str) -> None:
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write(text)


def _damage(ckpt: str) -> None:
    """``edited``: meta.json with another global_steps (its checksum kept); ``cut``: a truncated rank file."""
    for tag in ("edited", "cut"):
        shutil.copytree(os.path.join(ckpt, "good"), os.path.join(ckpt, tag))
    path = os.path.join(ckpt, "edited", "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta["global_steps"] += 1000
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
    victim = os.path.join(ckpt, "cut", "rank_00001.safetensors")
    os.truncate(victim, os.path.getsize(victim) - 100)


def _leave_stale_folders(ckpt: str) -> None:
    """What killed saves leave (of two tags), and a folder of the user's that only starts like one."""
    for name in (".tmp-old-0123abcd", ".tmp-good-deadbeef", ".tmp-notes"):
        os.makedirs(os.path.join(ckpt, name))
        with open(os.path.join(ckpt, name, "rank_00000.safetensors"), "wb") as f:
            f.write(b"partial")


def missing_cases(root: str) -> dict:
    rank = dist.get_rank()
    out = {}
    engine = make_engine(config(1), seed=0)
    train(engine, batches(1))
    nowhere, empty, ckpt = (os.path.join(root, n) for n in ("nothing-here", "empty", "ckpt"))
    load = engine.load_checkpoint

    out["missing_dir"] = _outcome(load, nowhere)
    out["missing_dir_ok"] = _outcome(load, nowhere, missing_ok=True)
    _on_rank0(os.makedirs, empty)
    out["no_latest"] = _outcome(load, empty)
    out["no_latest_ok"] = _outcome(load, empty, missing_ok=True)

    engine.save_checkpoint(ckpt, tag="good")
    out["missing_tag"] = _outcome(load, ckpt, tag="nope")
    out["missing_tag_ok"] = _outcome(load, ckpt, tag="nope", missing_ok=True)
    _on_rank0(_write_latest, ckpt, "gone")
    out["dangling_latest"] = _outcome(load, ckpt)
    out["dangling_latest_ok"] = _outcome(load, ckpt, missing_ok=True)
    _on_rank0(_write_latest, ckpt, "")
    out["empty_latest"] = _outcome(load, ckpt)
    out["empty_latest_ok"] = _outcome(load, ckpt, missing_ok=True)
    _on_rank0(_write_latest, ckpt, "good")

    _on_rank0(_damage, ckpt)
    out["edited_meta"] = _outcome(load, ckpt, tag="edited")
    out["edited_meta_ok"] = _outcome(load, ckpt, tag="edited", missing_ok=True)
    out["truncated_ok"] = _outcome(load, ckpt, tag="cut", missing_ok=True)
    # rank 1 looks elsewhere: both ranks must raise (none waits in a collective), missing_ok or not
    out["disagree_ok"] = _outcome(load, ckpt if rank == 0 else nowhere, missing_ok=True)

    _on_rank0(_leave_stale_folders, ckpt)
    engine.save_checkpoint(ckpt, tag="next")
    out["listing"] = sorted(os.listdir(ckpt))
    out["reserved_tag"] = _outcome(engine.save_checkpoint, ckpt, tag=".tmp-x-0123abcd")

    engine.global_steps = 0
    loaded = _outcome(load, ckpt, tag="good")
    out["good"] = (
        loaded[0],
        loaded[1][0] if loaded[0] == "returned" else loaded,
        engine.global_steps,
    )
    return out


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("missing"))
    return root, spawn(missing_cases, 2, root, timeout=120)


def _raised(outcome, kind) -> str:
    assert outcome[0] == "raised" and outcome[1] == kind, outcome
    return outcome[2]


def test_missing_directory_raises_unless_missing_ok(record):
    root, ranks = record
    for out in ranks:
        message = _raised(out["missing_dir"], "CheckpointNotFoundError")
        assert os.path.join(root, "nothing-here") in message and "missing_ok=True" in message, (
            message
        )
        assert out["missing_dir_ok"] == ("returned", (None, None))


def test_missing_latest_or_tag_raises_unless_missing_ok(record):
    root, ranks = record
    for out in ranks:
        message = _raised(out["no_latest"], "CheckpointNotFoundError")
        assert os.path.join(root, "empty", "latest") in message and "does not exist" in message, (
            message
        )
        message = _raised(out["missing_tag"], "CheckpointNotFoundError")
        assert "'nope'" in message and os.path.join(root, "ckpt", "nope") in message, message
        assert out["no_latest_ok"] == out["missing_tag_ok"] == ("returned", (None, None))


def test_latest_naming_a_missing_tag_raises(record):
    root, ranks = record
    for out in ranks:
        message = _raised(out["dangling_latest"], "CheckpointNotFoundError")
        assert os.path.join(root, "ckpt", "latest") in message and "'gone'" in message, message
        assert out["dangling_latest_ok"] == ("returned", (None, None))


def test_empty_latest_says_it_is_empty(record):
    root, ranks = record
    for out in ranks:
        for case in (
            "empty_latest",
            "empty_latest_ok",
        ):  # a damaged 'latest', not a missing checkpoint
            message = _raised(out[case], "CheckpointFileError")
            assert os.path.join(root, "ckpt", "latest") + " is empty" in message, message
            assert "meta.json" not in message, message


def test_edited_meta_is_refused(record):
    root, ranks = record
    for out in ranks:
        message = _raised(out["edited_meta"], "CheckpointFileError")
        assert (
            os.path.join(root, "ckpt", "edited", "meta.json") in message and "checksum" in message
        ), message
    with pytest.raises(
        CheckpointFileError, match="meta.json fails its checksum"
    ):  # the offline export too
        get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "ckpt"), tag="edited")


def test_missing_ok_does_not_hide_damage(record):
    _, ranks = record
    for out in ranks:
        assert "checksum" in _raised(out["edited_meta_ok"], "CheckpointFileError")
        assert "truncated" in _raised(out["truncated_ok"], "CheckpointFileError")


def test_ranks_that_find_different_checkpoints_all_raise(record):
    _, ranks = record
    for out in ranks:
        message = _raised(out["disagree_ok"], "CheckpointError")
        assert "rank 0: " in message and "rank 1: " in message and "does not exist" in message, (
            message
        )


def test_next_save_removes_stale_staging_folders(record):
    _, ranks = record
    for out in ranks:
        assert out["listing"] == [
            ".tmp-notes",
            "cut",
            "edited",
            "good",
            "latest",
            "next",
            "zero_to_fp32.py",
            "zero_to_torch.py",
        ], out["listing"]
        assert "reserved" in _raised(out["reserved_tag"], "ValueError")
        kind, directory, steps = out["good"]
        assert kind == "returned" and directory.endswith("good") and steps == 1, out["good"]


def test_meta_checksum_versions(record, tmp_path):
    """Version 1 (before the checksum) still loads; a version-2 meta.json without its checksum does not."""
    root, _ = record
    for version in (1, 2):
        directory = str(tmp_path / f"v{version}")
        shutil.copytree(os.path.join(root, "ckpt", "good"), directory)
        path = os.path.join(directory, "meta.json")
        with open(path) as f:
            meta = json.load(f)
        del meta[meta_mod.CHECKSUM]
        meta["version"] = version
        with open(path, "w") as f:
            json.dump(meta, f)
        if version == 1:
            assert get_fp32_state_dict_from_zero_checkpoint(directory)
        else:
            with pytest.raises(CheckpointFileError, match="has no 'meta_crc'"):
                meta_mod.read_meta(directory)


def test_find_without_processes(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        atomic.find(str(tmp_path / "none"))
    (tmp_path / "latest").write_text("  \n")
    with pytest.raises(CheckpointFileError, match="latest is empty"):
        atomic.find(str(tmp_path))
    assert isinstance(
        CheckpointNotFoundError("x"), FileNotFoundError
    )  # as the offline export raised before
