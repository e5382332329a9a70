"""``engine.save_checkpoint``: every rank writes the pieces it holds; rank 0 publishes atomically.

    save_dir/<tag>/
        rank_00000.safetensors ...  per rank: the pieces it holds of each fp32 master, of each per-element
                                    optimizer state and of the untrained parameters; rank 0 adds the buffers
        state.pt                    rank 0: optimizer hyper-parameters and scalar state, LR scheduler, loss
                                    scaler, every rank's RNG states, client_state
        meta.json                   written last (see meta.py)
    save_dir/latest                 the tag
    save_dir/zero_to_fp32.py        scripts that write one state_dict from a checkpoint, in fp32 or in a
    save_dir/zero_to_torch.py       dtype given (as DeepSpeed's; they need zengine only, no compat mode)

No rank gathers anything: each writes its own memory as it is (a device
tensor goes to the host one chunk at a time). The three steps, each ended by
a collective so that all ranks agree on success or failure:

1. rank 0 removes the staging directories that killed saves left (of any
   tag) and creates its own, ``.tmp-<tag>-<random>`` (atomic.py);
2. every rank writes and fsyncs its file; any error (a full disk) on any rank
   makes rank 0 remove the staging directory and every rank raise;
3. rank 0 writes state.pt and meta.json, renames the directory into place
   and updates ``latest``.
"""

from __future__ import annotations

import io
import os
import zlib
from typing import Any, Optional

import torch

from . import atomic, background, collectives, holdings, meta as meta_mod, rng
from ..errors import CheckpointSaveError
from .tensorfile import write_tensor_file


def save_checkpoint(
    engine,
    save_dir: str,
    tag: Optional[str] = None,
    client_state: Optional[dict] = None,
    save_latest: bool = True,
    async_save: bool = False,
    exclude_frozen: bool = False,
) -> bool:
    """Collective: write a checkpoint of ``engine`` to ``save_dir/tag``; see the module doc. ``async_save``:
    snapshot to host memory and write in the background (background.py). ``exclude_frozen``
    (DeepSpeed's ``exclude_frozen_parameters``): the parameters that do not require grad are left
    out; a load keeps the model's own values of them (``load_module_strict=False``, as a PEFT
    run's resume loads) or names them missing."""
    tag, staging = begin(engine, save_dir, tag)
    excluded = holdings.frozen_names(engine.module) if exclude_frozen else frozenset()
    with engine.optimizer.states_resident():
        if async_save:
            _start_background(engine, staging, save_dir, tag, client_state, save_latest, excluded)
        else:
            _write(engine, staging, save_dir, tag, client_state, save_latest, excluded)
    return True


def begin(engine, save_dir: str, tag: Optional[str]) -> tuple[str, str]:
    """Collective, the start of every save (any format): the previous asynchronous save finished, the
    ranks agreed on the tag, rank 0 made the staging folder; returns (tag, staging folder)."""
    background.wait(engine)  # the previous asynchronous save first (its errors raise here)
    group = engine.optimizer.dp_group
    rank = engine.global_rank
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tags = collectives.all_gather(tag, group)
    if len(set(tags)) > 1:
        raise ValueError(
            f"save_checkpoint: every rank must pass the same tag; got {tags} (by rank)"
        )
    if tag == atomic.LATEST or atomic.is_protocol_name(tag):
        raise ValueError(
            f"save_checkpoint: tag {tag!r} is reserved: saves write '{atomic.LATEST}' and remove "
            f"folders named like {atomic.STAGING_PREFIX}<tag>-<8 hex digits>; choose another tag"
        )

    staging, error = None, None
    if rank == 0:
        try:
            staging = atomic.make_staging_dir(save_dir, tag)
        except OSError as e:
            error = f"cannot create a directory in {save_dir}: {e}"
    staging, error = collectives.broadcast((staging, error), group)
    if error:
        raise CheckpointSaveError(f"save_checkpoint: {error}")
    return tag, staging


def _write(
    engine, staging: str, save_dir: str, tag: str, client_state, save_latest: bool, excluded
) -> None:
    """The rank files, then (rank 0) the shared files and the publishing rename; errors on any rank raise on all."""
    group, rank = engine.optimizer.dp_group, engine.global_rank
    path = os.path.join(staging, meta_mod.rank_file(rank))
    try:
        entries, mine = _rank_part(engine, excluded)
        info = write_tensor_file(path, entries, {"rank": rank, "pieces": mine["pieces"]})
        mine.update(size=info.size, crc=info.header_crc)
    except Exception as e:  # a full disk, a permission: reported on every rank below
        mine = {"error": f"rank {rank} writing {path}: {type(e).__name__}: {e}"}
    everyone = collectives.all_gather(mine, group)
    errors = [r["error"] for r in everyone if "error" in r]

    if rank == 0:
        if not errors:
            try:
                _finish(
                    staging,
                    save_dir,
                    tag,
                    *_shared_part(engine, client_state, everyone, excluded),
                    everyone,
                    save_latest,
                )
            except Exception as e:
                errors = [f"rank 0: {type(e).__name__}: {e}"]
        if errors:
            atomic.discard(staging)
    errors = collectives.broadcast(errors, group)
    if errors:
        raise CheckpointSaveError(
            f"save_checkpoint: could not write checkpoint {tag!r} in {save_dir}; the previous "
            f"checkpoint and 'latest' are untouched:\n  " + "\n  ".join(errors)
        )


def _start_background(
    engine, staging: str, save_dir: str, tag: str, client_state, save_latest: bool, excluded
) -> None:
    """Snapshot this rank's part to host memory, agree that every rank has, and leave the writing to a thread
    (background.py); rank 0 also captures the shared part now, before training changes it."""
    group, rank = engine.optimizer.dp_group, engine.global_rank
    path = os.path.join(staging, meta_mod.rank_file(rank))
    try:
        entries, mine = _rank_part(engine, excluded)
        snapshot, ready = background.host_snapshot(entries)
    except Exception as e:  # out of host memory: reported on every rank below
        mine = {
            "error": f"rank {rank} copying its part of the checkpoint to host memory: {type(e).__name__}: {e}"
        }
    everyone = collectives.all_gather(mine, group)
    errors = [r["error"] for r in everyone if "error" in r]
    shared = None
    if rank == 0 and not errors:
        try:
            shared = _shared_part(engine, client_state, everyone, excluded)
        except Exception as e:
            errors = [f"rank 0: {type(e).__name__}: {e}"]
    errors = collectives.broadcast(errors, group)
    if errors:
        if rank == 0:
            atomic.discard(staging)
        raise CheckpointSaveError(
            f"save_checkpoint: could not start checkpoint {tag!r} in {save_dir}; the previous "
            f"checkpoint and 'latest' are untouched:\n  " + "\n  ".join(errors)
        )

    def write() -> dict:
        if ready is not None:
            ready.synchronize()  # the device-to-host copies have landed
        info = write_tensor_file(path, snapshot, {"rank": rank, "pieces": mine["pieces"]})
        snapshot.clear()
        return {"size": info.size, "crc": info.header_crc}

    def finish(posted: list[dict]) -> None:  # rank 0's thread, once every rank posted its file
        full = [{**before, **after} for before, after in zip(everyone, posted)]
        _finish(staging, save_dir, tag, *shared, full, save_latest)

    ranks = collectives.group_ranks(group)
    name = (
        f"{os.path.basename(staging)}"  # unique per save (rank 0's random staging name, broadcast)
    )
    background.track(
        engine,
        background.BackgroundSave(
            name, rank, ranks, staging, save_dir, tag, write, finish if rank == 0 else None
        ).start(),
    )


def _rank_part(engine, excluded: frozenset) -> tuple[list, dict]:
    """This rank's file entries, and what it tells rank 0 about them (pieces, state keys, RNG, step scalars)."""
    entries, pieces, state_keys = _rank_entries(engine, excluded)
    return entries, {
        "pieces": pieces,
        "keys": state_keys,
        "rng": rng.capture(),
        "scalars_by_count": _scalars_by_count(engine.optimizer),
    }


def _rank_entries(engine, excluded: frozenset) -> tuple[list, dict, list]:
    """(key, tensor view) pairs this rank writes, the pieces index {name: [start, end]}, and the per-element
    optimizer state keys (the untrained parameters named in ``excluded`` left out)."""
    opt, rank, world = engine.optimizer, engine.global_rank, engine.world_size
    entries, pieces, state_keys = [], {}, []
    for gi, master in enumerate(holdings.masters(opt, world, saving=True)):
        states = holdings.elementwise_state(opt, gi)
        state_keys += [k for k in states if k not in state_keys]
        for p in master.pieces:
            pieces[p.name] = [p.start, p.end]
            entries.append((f"master/{p.name}", master.view(p)))
            entries += [
                (f"state.{k}/{p.name}", t.narrow(0, p.offset, p.numel)) for k, t in states.items()
            ]
    for held in holdings.untrained(engine.module, opt, rank, world, saving=True):
        for p in held.pieces:
            if p.name in excluded:
                continue
            pieces[p.name] = [p.start, p.end]
            entries.append((f"param/{p.name}", held.view(p)))
    if rank == 0:
        entries += [(f"buffer/{n}", b) for n, b in holdings.buffers(engine.module).items()]
    return entries, pieces, state_keys


def _scalars_by_count(opt) -> list[dict]:
    """Per group, this rank's non-element optimizer states of each step count its pieces have (a plain torch
    optimizer whose parameters stepped unequally often: zero/step_counts.py)."""
    if opt.abilities.steps_runs:  # it steps from the counts alone
        return [{} for _ in opt.shard_params]
    with torch.no_grad():
        return [
            opt.run_stepper.state_dict(opt.optimizer, gi, sp)
            for gi, sp in enumerate(opt.shard_params)
        ]


def _engine_state(engine, client_state, everyone) -> dict[str, Any]:
    opt = engine.optimizer
    records = [_group_record(opt, gi, everyone) for gi in range(len(opt.shard_params))]
    # one record per param group of the wrapped optimizer: partial offload's sub-groups merged, so
    # that the checkpoint is the same whatever the split (zero/sub_groups.py)
    groups = [
        _merged(opt, pg, [records[gi] for gi in opt.group_map.members(pg)])
        for pg in range(opt.group_map.count)
    ]
    return {
        "optimizer": groups,
        "lr_scheduler": engine.lr_scheduler.state_dict()
        if engine.lr_scheduler is not None
        else None,
        "loss_scaler": engine.scaler.state_dict(),
        "rng": [r["rng"] for r in everyone],
        "client_state": client_state if client_state is not None else {},
    }


def _group_record(opt, gi: int, everyone) -> dict[str, Any]:
    """Group ``gi``'s state.pt record, its hyper-parameters left to its param group."""
    state = opt.optimizer.state.get(opt.shard_params[gi], {})
    elementwise = holdings.elementwise_state(opt, gi)
    return {
        "keys": list(state),  # in the optimizer's order
        "scalars": {
            k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
            for k, v in state.items()
            if k not in elementwise
        },
        # per parameter, as torch counts steps (a parameter without a gradient is not stepped), and the
        # scalars of every count any rank's pieces have: a rank of another world size finds its own
        "step_counts": opt.step_counts.state_dict(gi),
        "flat_count": opt.run_stepper.flat_count[gi],
        "scalars_by_count": {c: s for r in everyone for c, s in r["scalars_by_count"][gi].items()},
    }


def _merged(opt, pg: int, records: list[dict]) -> dict[str, Any]:
    """Param group ``pg``'s record from its groups' (one, unless partial offload cut sub-groups, whose
    optimizer steps by runs and keeps no scalars but CPU-Adam's ``step``, the largest of which stands)."""
    first = records[0]
    merged = {"hyper": {k: v for k, v in opt.optimizer.param_groups[pg].items() if k != "params"}}
    merged.update(first)
    for other in records[1:]:
        merged["keys"] = merged["keys"] + [k for k in other["keys"] if k not in merged["keys"]]
        scalars = dict(merged["scalars"])
        for k, v in other["scalars"].items():
            scalars[k] = v if k not in scalars or float(v) > float(scalars[k]) else scalars[k]
        merged["scalars"] = scalars
        merged["step_counts"] = {**merged["step_counts"], **other["step_counts"]}
        merged["flat_count"] = max(merged["flat_count"], other["flat_count"])
    return merged


def _shared_part(engine, client_state, everyone: list, excluded: frozenset) -> tuple[bytes, dict]:
    """Rank 0: state.pt's bytes and meta.json's engine fields, read from the engine now."""
    buf = io.BytesIO()
    torch.save(_engine_state(engine, client_state, everyone), buf)
    meta = {
        "world_size": engine.world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "compute_dtype": meta_mod.dtype_name(engine.config.compute_dtype),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        **meta_mod.describe_model(
            engine.module, holdings.trained_names(engine.optimizer), excluded
        ),
    }
    return buf.getvalue(), meta


def _finish(
    staging: str,
    save_dir: str,
    tag: str,
    raw: bytes,
    engine_meta: dict,
    everyone: list,
    save_latest: bool,
) -> None:
    """Rank 0: state.pt and meta.json into the staging directory, then rename it into place."""
    with open(os.path.join(staging, meta_mod.STATE), "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    files = {
        meta_mod.rank_file(r): {"size": info["size"], "crc": info["crc"]}
        for r, info in enumerate(everyone)
    }
    files[meta_mod.STATE] = {"size": len(raw), "crc": zlib.crc32(raw)}
    index: dict[str, list] = {}
    for r, info in enumerate(everyone):
        for name, (start, end) in info["pieces"].items():
            index.setdefault(name, []).append([r, start, end])
    keys = []
    for info in everyone:
        keys += [k for k in info["keys"] if k not in keys]
    meta = {
        "format": meta_mod.FORMAT,
        "version": meta_mod.VERSION,
        "tag": tag,
        **engine_meta,
        "optimizer_state_keys": keys,
        "files": files,
        "pieces": index,
    }
    meta_mod.write_meta(staging, meta)
    # as DeepSpeed does: scripts beside the checkpoints that turn one into a single state_dict
    # (before publishing: a failure here leaves the previous checkpoint and 'latest' as they were)
    for name, text in RECOVERY_SCRIPTS.items():
        atomic.write_text(save_dir, name, text, 0o755)
    atomic.publish(staging, save_dir, tag, save_latest)


_SCRIPT = """#!/usr/bin/env python
# Written by zengine beside its checkpoints, as DeepSpeed writes its own. Turns one checkpoint, zengine's
# or DeepSpeed's, into a single state_dict, without GPUs and with zengine only (no DeepSpeed):
#   python {name} . OUTPUT_DIR_OR_FILE {usage}
import sys

from zengine.utils.zero_to_fp32 import {main}

sys.exit({main}())
"""
RECOVERY_SCRIPTS = {
    "zero_to_fp32.py": _SCRIPT.format(
        name="zero_to_fp32.py", usage="[--tag TAG] [--safe_serialization]", main="main"
    ),
    "zero_to_torch.py": _SCRIPT.format(
        name="zero_to_torch.py", usage="--dtype {fp32,fp16,bf16} [--tag TAG]", main="torch_main"
    ),
}
