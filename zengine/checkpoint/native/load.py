"""``engine.load_checkpoint``: each rank reads the saved pieces that overlap what it holds now.

First the ranks agree on the checkpoint directory: each looks for it
(``atomic.find``) and all compare what they found, so that every rank loads
the same one or every rank raises the same error (a missing directory,
``latest`` or tag; with ``missing_ok`` that alone returns ``(None, None)``).

The engine's layout (world size, stage, offload) may differ from the one that
saved: a rank asks its groups for its pieces (``holdings.py``), and the
reader fills each from whichever rank files hold those elements, so nothing is
gathered and a rank reads only what it holds. Two phases:

1. read (no collective): meta.json checked against the model, state.pt
   (weights-only: safe_load.py), then the fp32 masters, the optimizer
   states, the untrained parameters and the buffers are read in place; any
   failure on any rank is reported on every rank before phase 2, so no rank
   is left waiting in a collective;
2. write back: the compute-dtype parameters from the masters, then each
   group's ``publish`` (stages 1-2 gather the flat buffer, stage 3 refreshes
   the parameters that stay whole); counters, loss scaler, LR scheduler and
   this rank's RNG states.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...log import logger
from . import collectives, holdings, meta as meta_mod, rng
from ..formats import find, open_reader
from ..errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointUntrustedError,
)
from .holdings import Holding
from .pieces import overlaps
from .reader import CheckpointReader


def load_checkpoint(
    engine,
    load_dir: str,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    missing_ok: bool = False,
    *,
    trust_client_state: bool = False,
    strict: bool = True,
):
    """Collective: load ``load_dir/tag`` (default: the tag in ``load_dir/latest``) into ``engine``.

    Returns ``(checkpoint directory, client_state)``. When there is no checkpoint there (no ``load_dir``,
    no ``latest``, no such tag) it raises CheckpointNotFoundError, or with ``missing_ok`` returns
    ``(None, None)``; an empty ``latest`` or a damaged checkpoint raises either way.
    ``load_module_only`` loads the parameters and buffers alone. Not ``strict`` (DeepSpeed's
    ``load_module_strict=False``): parameters and buffers the checkpoint lacks keep their values (and start
    with fresh optimizer state), those only the checkpoint has are ignored, both named on rank 0; a reshaped
    one still raises.

    state.pt is unpickled weights-only (tensors and plain values; see safe_load.py): an object of another
    type (say in ``client_state``) raises CheckpointUntrustedError on every rank, and nothing of the file
    runs. ``trust_client_state=True`` unpickles anything: only for checkpoints whose origin you trust.
    """
    try:
        directory = _agree_on_directory(engine, load_dir, tag)
    except CheckpointNotFoundError as e:
        if not missing_ok:
            raise CheckpointNotFoundError(
                f"load_checkpoint: {e}; pass missing_ok=True to start without "
                f"a checkpoint when there is none"
            ) from None
        if engine.global_rank == 0:
            logger.info(f"load_checkpoint: nothing loaded (missing_ok=True): {e}")
        return None, None

    opt, rank = engine.optimizer, engine.global_rank
    with_optimizer = load_optimizer_states and not load_module_only
    failure = None
    try:
        with opt.states_resident():
            state = _read(engine, directory, with_optimizer, trust_client_state, strict)
    except Exception as e:  # reported on every rank before any collective of phase 2
        failure = e
    errors = collectives.all_gather(
        None if failure is None else (type(failure).__name__, f"rank {rank}: {failure}"),
        opt.dp_group,
    )
    if failure is not None:
        raise failure
    if any(errors):  # another rank failed: the same error class when it was a refused state.pt
        untrusted = any(e[0] == CheckpointUntrustedError.__name__ for e in errors if e)
        raise (CheckpointUntrustedError if untrusted else CheckpointError)(
            f"load_checkpoint: {directory} could not be loaded:\n  "
            + "\n  ".join(e[1] for e in errors if e)
        )

    _write_back(opt)
    opt.zero_grad()
    if not load_module_only:
        meta = state["meta"]
        engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
        # a fresh global batch begins here, whatever accumulation steps the saved count was made with
        engine.accumulation.start_window(engine.micro_steps)
        engine.global_samples = meta["global_samples"]
        if set(state["loss_scaler"]) == set(engine.scaler.state_dict()):  # the same kind of scaler
            engine.scaler.load_state_dict(state["loss_scaler"])
        if (
            load_lr_scheduler_states
            and engine.lr_scheduler is not None
            and state["lr_scheduler"] is not None
        ):
            _load_scheduler(engine, directory, state["lr_scheduler"])
        if rank < len(state["rng"]):  # new ranks of a larger world keep their own generators
            rng.restore(state["rng"][rank])
    return directory, state["client_state"]


def _load_scheduler(engine, directory: str, saved: dict) -> None:
    """The saved scheduler state into the engine's scheduler; one of another kind (a DCP checkpoint's
    torch scheduler beside zengine's WarmupLR) is refused by name with the way out."""
    mine = engine.lr_scheduler.state_dict()
    if isinstance(saved, dict) and isinstance(mine, dict) and set(saved) != set(mine):
        raise CheckpointMismatchError(
            f"load_checkpoint: the LR scheduler state in {directory} ({', '.join(sorted(saved))}) is "
            f"not of the engine's scheduler ({', '.join(sorted(mine))}); build the same scheduler, "
            "or load_checkpoint(..., load_lr_scheduler_states=False)"
        )
    engine.lr_scheduler.load_state_dict(saved)


def _agree_on_directory(engine, load_dir: str, tag: Optional[str]) -> str:
    """The checkpoint directory every rank found; else on every rank the error they all met, or a
    CheckpointError listing what each rank found when they differ (never a CheckpointNotFoundError then)."""
    try:
        mine, failure = find(load_dir, tag, engine.config.checkpoint.load_universal), None
    except Exception as e:  # compared below, so that no rank goes on alone into a collective
        mine, failure = None, e
    found = collectives.all_gather(
        (mine, None if failure is None else (type(failure).__name__, str(failure))),
        engine.optimizer.dp_group,
    )
    if all(f == found[0] for f in found):
        if failure is not None:
            raise failure
        return mine
    seen = [d if err is None else err[1] for d, err in found]
    raise CheckpointError(
        f"load_checkpoint: the ranks do not find the same checkpoint for {load_dir!r} "
        f"(tag {tag!r}); each must see the same files:\n  "
        + "\n  ".join(f"rank {r}: {what}" for r, what in enumerate(seen))
    )


def _read(
    engine, directory: str, with_optimizer: bool, trusted: bool, strict: bool = True
) -> dict[str, Any]:
    """Phase 1: check the checkpoint and read this rank's share of it in place; state.pt (weights-only unless
    ``trusted``) with the meta."""
    opt, module = engine.optimizer, engine.module
    ours = meta_mod.describe_model(module, holdings.trained_names(opt))
    # zengine's own layout, DeepSpeed's or DCP's (formats.py): the same questions answered from each
    with open_reader(
        directory,
        trusted,
        holdings.param_group_names(opt),
        engine.gradient_accumulation_steps(),
        ours,
    ) as reader:
        meta = reader.meta
        if engine.global_rank == 0:
            _log_foreign(directory, meta, engine)
        lacking = meta_mod.check_same_model(meta, ours, directory, strict)
        if not strict and engine.global_rank == 0:
            _log_lenient(
                directory,
                lacking,
                {n for kind in ("params", "buffers") for n in meta[kind] if n not in ours[kind]},
            )
        state = reader.read_state(trusted)
        saved_groups = len(state["optimizer"] or [])  # 0: written by an engine without an optimizer
        if with_optimizer and saved_groups != opt.group_map.count:
            raise CheckpointMismatchError(
                f"checkpoint {directory} has {saved_groups} optimizer param groups, the engine "
                f"{opt.group_map.count}; load_checkpoint(..., load_optimizer_states=False) loads the "
                "model alone"
            )
        for gi, master in enumerate(holdings.masters(opt, engine.world_size, saving=False)):
            reader.fill(_present(master, lacking), ("master", "param"))
            if gi == 0:
                _log_master_cast(directory, reader, master)
            if with_optimizer:  # (a param group's record serves each of its sub-groups)
                saved = state["optimizer"][opt.group_map.owner[gi]]
                _load_optimizer_group(reader, opt, gi, master, saved)
        for held in holdings.untrained(
            module, opt, engine.global_rank, engine.world_size, saving=False
        ):
            reader.fill(_present(held, lacking), ("param", "master"))
        for name, b in holdings.buffers(module).items():
            if name not in lacking:
                reader.buffer_into(name, b.data)
    state["meta"] = meta
    return state


def _log_foreign(directory: str, meta: dict, engine) -> None:
    """Name the format of a checkpoint zengine did not write, once."""
    where = f"loading it into stage {engine.zero_optimization_stage()} on {engine.world_size}"
    if meta.get("format") in ("deepspeed", "deepspeed-universal"):
        logger.info(
            f"load_checkpoint: {directory} is a DeepSpeed {meta['ds_version']} ZeRO-{meta['zero_stage']} "
            f"{'universal ' if meta['format'] != 'deepspeed' else ''}checkpoint of "
            f"{meta['world_size']} ranks; {where}"
        )
    elif meta.get("format") == "dcp":
        logger.info(f"load_checkpoint: {directory} is a DCP checkpoint; {where}")


def _log_master_cast(directory: str, reader: CheckpointReader, master: Holding) -> None:
    """One log line when the checkpoint's masters have another dtype than this engine's (fp32
    masters into bf16_master_weights_and_grads, or back): they were cast as they were read."""
    if not isinstance(reader, CheckpointReader):
        return  # DeepSpeed's layout: its reader casts as it reads, its dtypes are its files'
    for piece in master.pieces:
        for rank, *_ in overlaps(piece, reader.meta["pieces"].get(piece.name, [])):
            entries = reader.file(rank).entries
            saved = entries.get(f"master/{piece.name}", (None,))[0]
            if saved is not None and saved != master.buffer.dtype:
                logger.warning(
                    f"load_checkpoint from {directory}: masters saved in {saved} are cast to "
                    f"{master.buffer.dtype} (bf16/fp16 *_master_weights_and_grads differs from the run "
                    "that saved them), optimizer states to the dtypes this run keeps"
                )
            return


def _present(held: Holding, lacking: set[str]) -> Holding:
    """``held`` without the pieces of parameters the checkpoint lacks (load_module_strict=False keeps them)."""
    return (
        held
        if not lacking
        else Holding(held.buffer, [p for p in held.pieces if p.name not in lacking])
    )


def _log_lenient(directory: str, lacking: set[str], ignored: set[str]) -> None:
    if lacking or ignored:
        logger.warning(
            f"load_checkpoint(load_module_strict=False) from {directory}: "
            + (
                f"not in the checkpoint, kept as they are: {', '.join(sorted(lacking))}; "
                if lacking
                else ""
            )
            + (f"only in the checkpoint, ignored: {', '.join(sorted(ignored))}" if ignored else "")
        )


def _load_optimizer_group(
    reader: CheckpointReader, opt, gi: int, master: Holding, saved: dict[str, Any]
) -> None:
    """The wrapped optimizer's state for group ``gi``: per-element tensors re-sliced to this rank's
    pieces (zeros where the checkpoint has none), scalars (``step``) as saved; and the hyper-parameters."""
    # torch keeps ``step`` on the host unless the optimizer is capturable or fused: this engine's optimizer
    # decides, not the saving one's (a checkpoint saved on CPU loads into a fused GPU optimizer)
    group = opt.optimizer.param_groups[opt.group_map.owner[gi]]
    on_device = bool(group.get("capturable") or group.get("fused"))
    shard = opt.shard_params[gi]
    current = opt.optimizer.state.get(shard, {})
    state = {}
    for key in saved["keys"]:
        if key in saved["scalars"]:
            value = saved["scalars"][key]
            if torch.is_tensor(value):
                # a copy each: a param group's record serves each of its sub-groups, and a fused
                # optimizer adds one to every ``step`` tensor it holds
                value = value.to(master.buffer.device, copy=True) if on_device else value.clone()
            state[key] = value
        else:  # read in place into the tensor the optimizer has, else into a new one
            # in the dtype this optimizer keeps it in (bf16 masters: bf16 or fp32 moments), cast
            # from the checkpoint's; a key it does not keep (Kahan's compensation) is dropped
            dtype = opt.abilities.state_dtype(shard, key)
            if dtype is None:
                continue
            tensor = current.get(key)
            if not (
                torch.is_tensor(tensor)
                and tensor.shape == master.buffer.shape
                and tensor.dtype == dtype
                and tensor.device == master.buffer.device
            ):
                tensor = torch.empty_like(master.buffer, dtype=dtype)
            holdings.zero_gaps(tensor, master.pieces)
            reader.fill(Holding(tensor, master.pieces), (f"state.{key}",), required=False)
            state[key] = tensor
    if state:
        opt.optimizer.state[shard] = state
    else:
        opt.optimizer.state.pop(shard, None)
    group.update(saved["hyper"])
    # Per-parameter step counts (zero/step_counts.py); a checkpoint from before them stepped every parameter
    # alike: its flat count ("step"; 1 for an optimizer without one that has states, as SGD's momentum)
    step = saved["scalars"].get("step")
    fallback = int(step) if step is not None else int(bool(saved["keys"]))
    opt.step_counts.load_state_dict(gi, saved.get("step_counts"), fallback)
    # the flat entries belong to the count their "step" says (an optimizer that steps runs itself, as CPUAdam,
    # keeps no flat count of its own)
    flat_count = int(step) if step is not None else saved.get("flat_count", fallback)
    opt.run_stepper.load_state_dict(group, gi, shard, saved.get("scalars_by_count"), flat_count)


def _write_back(opt) -> None:
    """Phase 2: the compute-dtype parameters from the loaded masters, published to the ranks that need them."""
    with torch.no_grad():
        opt.write_back()
        frozen = getattr(opt, "frozen", None)
        if frozen is not None:
            frozen.publish(opt.allgather_bucket_numel, opt.comm_group)
