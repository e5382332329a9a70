"""Loading a checkpoint never runs code from it unless told to: state.pt is unpickled weights-only.

Everything zengine writes (optimizer hyper-parameters and scalars, scheduler, loss scaler, every generator's
state) loads so, and so do tensors and plain values in ``client_state``; an object of a user's class raises
CheckpointUntrustedError on every rank unless ``load_checkpoint(..., trust_client_state=True)``; a pickle
whose unpickling would run code does not run. One spawn (2 ranks) runs every case; the tests check the record.
"""

import io
import json
import os
import random
import shutil
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from checkpoint_runs import batches, config, make_engine, train
from harness import spawn
from zengine.checkpoint import (
    CheckpointError,
    CheckpointUntrustedError,
    get_fp32_state_dict_from_zero_checkpoint,
)
from zengine.checkpoint.export import to_fp32
from zengine.checkpoint.native import meta as meta_mod, safe_load
from zengine.utils import zero_to_fp32


class Note:
    """A user's own class in client_state."""

    def __init__(self, text: str):
        self.text = text


class Payload:
    """What a hostile checkpoint holds: unpickling it runs code (here: it creates ``marker``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def plain_client_state() -> dict:
    return {
        "epoch": 3,
        "loss": 0.25,
        "name": "run-1",
        "history": [1, 2.5, "x", None, True],
        "shape": (2, 3),
        "nested": {
            "ids": {4, 5},
            "scale": torch.tensor([1.5, -2.0]),
            "big": torch.arange(6).view(2, 3),
        },
    }


def numpy_client_state() -> dict:
    return {
        "np": np.arange(3, dtype=np.int64),
        "np_scalar": np.float32(0.5),
        "mask": np.array([True, False]),
    }


def _same(a, b) -> bool:
    if torch.is_tensor(a) or isinstance(a, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and bool((a == b).all())
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _outcome(fn, *args, **kwargs) -> tuple:
    try:
        fn(*args, **kwargs)
        return ("returned",)
    except Exception as e:
        return ("raised", type(e).__name__, str(e), isinstance(e, CheckpointError))


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def _on_rank0(fn, *args) -> None:
    if dist.get_rank() == 0:
        fn(*args)
    dist.barrier()


def _as_older_checkpoint(src: str, dst: str) -> None:
    """A copy of ``src`` as zengine wrote it before weights-only loading: NumPy's RNG key as a NumPy array."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, meta_mod.STATE)
    state = torch.load(path, weights_only=False)  # (our own file)
    for ranks in state["rng"]:
        name, keys, *rest = ranks["numpy"]
        ranks["numpy"] = (name, np.array(keys, dtype=np.uint32), *rest)
    torch.save(state, path)
    with open(path, "rb") as f:
        raw = f.read()
    with open(os.path.join(dst, meta_mod.META)) as f:
        meta = json.load(f)
    meta["files"][meta_mod.STATE] = {"size": len(raw), "crc": zlib.crc32(raw)}
    meta_mod.write_meta(dst, meta)


def _export(root: str, tag: str) -> None:
    get_fp32_state_dict_from_zero_checkpoint(root, tag)
    assert to_fp32.main([root, os.path.join(root, f"{tag}.bin"), "--tag", tag]) == 0
    assert zero_to_fp32.main([root, os.path.join(root, f"{tag}-out"), "-t", tag]) == 0


def trust_cases(root: str) -> dict:
    rank = dist.get_rank()
    out = {}
    engine = make_engine(config(1, "fp16", scheduler=True), seed=0)
    train(engine, batches(2))
    load = engine.load_checkpoint

    # what zengine writes, and plain client_state values: loaded weights-only, everything as saved
    engine.save_checkpoint(root, tag="plain", client_state=plain_client_state())
    out["draws_saved"] = _draws()
    fresh = make_engine(config(1, "fp16", scheduler=True), seed=1)
    _scramble()
    _, client = fresh.load_checkpoint(root, tag="plain")
    out["draws_loaded"] = _draws()
    out["plain_client"] = _same(client, plain_client_state())
    out["plain_resumed"] = (fresh.global_steps, fresh.get_lr(), fresh.loss_scale) == (
        engine.global_steps,
        engine.get_lr(),
        engine.loss_scale,
    )
    out["plain_unsafe_globals"] = torch.serialization.get_unsafe_globals_in_checkpoint(
        os.path.join(root, "plain", meta_mod.STATE)
    )  # torch's own allow-list, nothing added

    _on_rank0(_as_older_checkpoint, os.path.join(root, "plain"), os.path.join(root, "older"))
    out["older_unsafe_globals"] = torch.serialization.get_unsafe_globals_in_checkpoint(
        os.path.join(root, "older", meta_mod.STATE)
    )
    _scramble()
    out["older"] = _outcome(fresh.load_checkpoint, root, tag="older")
    out["draws_older"] = _draws()

    # NumPy arrays and scalars of numeric dtypes are data too
    engine.save_checkpoint(root, tag="numpy", client_state=numpy_client_state())
    _, client = load(root, tag="numpy")
    out["numpy_client"] = _same(client, numpy_client_state())

    # an object of the user's class: refused on every rank unless trusted
    engine.save_checkpoint(root, tag="custom", client_state={"epoch": 1, "note": Note("kept")})
    out["custom"] = _outcome(load, root, tag="custom")
    out["custom_rank1_refuses"] = _outcome(load, root, tag="custom", trust_client_state=rank == 0)
    _, client = load(root, tag="custom", trust_client_state=True)
    out["custom_trusted"] = (type(client["note"]).__name__, client["note"].text, client["epoch"])

    # a hostile pickle: nothing runs on a default load, nor in the offline exports
    marker = os.path.join(root, "marker")
    engine.save_checkpoint(root, tag="payload", client_state={"epoch": 1, "x": Payload(marker)})
    out["payload"] = _outcome(load, root, tag="payload")
    _on_rank0(_export, root, "payload")
    out["marker_after_default"] = os.path.exists(marker)
    dist.barrier()
    load(root, tag="payload", trust_client_state=True)  # the payload is real: trusted, it runs
    out["marker_after_trusted"] = os.path.exists(marker)
    return out


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trust"))
    return root, spawn(trust_cases, 2, root, timeout=240)


def test_what_zengine_writes_loads_weights_only_and_resumes(record):
    _, ranks = record
    for out in ranks:
        assert out["plain_unsafe_globals"] == [], (
            "state.pt holds types torch.load(weights_only=True) refuses"
        )
        assert out["plain_client"] and out["plain_resumed"]
        assert out["draws_loaded"] == out["draws_saved"], "the generators were not restored"
    assert ranks[0]["draws_saved"] != ranks[1]["draws_saved"]  # each rank gets its own states back


def test_older_checkpoints_and_numpy_values_still_load(record):
    _, ranks = record
    for out in ranks:
        assert "numpy.ndarray" in out["older_unsafe_globals"], out["older_unsafe_globals"]
        assert out["older"] == ("returned",), out["older"]
        assert out["draws_older"] == out["draws_saved"]
        assert out["numpy_client"]


def test_user_class_in_client_state_needs_trust_on_every_rank(record):
    root, ranks = record
    for rank, out in enumerate(ranks):
        kind, name, message, is_checkpoint_error = out["custom"]
        assert (kind, name, is_checkpoint_error) == ("raised", "CheckpointUntrustedError", True), (
            out["custom"]
        )
        for expected in (
            os.path.join(root, "custom", "state.pt"),
            "test_checkpoint_trust.Note",
            "load_checkpoint(..., trust_client_state=True)",
        ):
            assert expected in message, message
        # rank 0 trusts it, rank 1 does not: both raise (none is left waiting in a collective), the same class
        kind, name, message, _ = out["custom_rank1_refuses"]
        assert (kind, name) == ("raised", "CheckpointUntrustedError"), out["custom_rank1_refuses"]
        assert rank == 1 or "rank 1: " in message, message
        assert out["custom_trusted"] == ("Note", "kept", 1)


def test_hostile_pickle_does_not_run(record):
    root, ranks = record
    for out in ranks:
        kind, name, message, _ = out["payload"]
        assert (kind, name) == ("raised", "CheckpointUntrustedError"), out["payload"]
        assert os.path.join(root, "payload", "state.pt") in message and "exec" in message, message
        assert not out["marker_after_default"], (
            "a default load_checkpoint (or an export) ran the checkpoint's code"
        )
        assert out["marker_after_trusted"]


class SystemPayload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_state_file_loading_without_processes(tmp_path):
    """A module torch blocks (os.system) is named too; the user's own safe globals outlive a load."""
    assert issubclass(CheckpointUntrustedError, CheckpointError)
    marker = str(tmp_path / "marker")
    buf = io.BytesIO()
    torch.save({"client_state": SystemPayload(marker)}, buf)
    with pytest.raises(
        CheckpointUntrustedError, match=r"holds objects \((posix|nt)\.system\)"
    ) as err:
        safe_load.load_state(buf.getvalue(), "somewhere/state.pt")
    assert "somewhere/state.pt" in str(err.value) and "is blocked" in str(err.value)
    assert not os.path.exists(marker)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(
        [np.ndarray]
    )  # the user's, also among what a load allows for a while
    try:
        buf = io.BytesIO()
        torch.save({"a": np.arange(2, dtype=np.uint32)}, buf)
        assert safe_load.load_state(buf.getvalue(), "x")["a"].tolist() == [0, 1]
        assert np.ndarray in torch.serialization.get_safe_globals()
        assert np.dtype not in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
