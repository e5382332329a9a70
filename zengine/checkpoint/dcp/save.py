"""``engine.save_checkpoint(..., checkpoint_format="dcp")``: a DCP checkpoint FSDP2 loads as its own.

    save_dir/<tag>/
        __<rank>_0.distcp      each rank: the boxes of the pieces it holds (boxes.flat_boxes), no gather
        .metadata              rank 0, last (DCP's)
    save_dir/latest            the tag

In the layout of PyTorch's tutorial, ``{"model": ..., "optim": ...}`` as ``get_state_dict`` gives them:

    model.<key>                      every state_dict key (a tied name too): fp32 masters of the trained
                                     parameters, the untrained in the compute dtype, buffers (rank 0)
    optim.state.<fqn>.<key>          exp_avg, exp_avg_sq... of every trained parameter (zeros where it
                                     never stepped), ``step`` its step count (0-d fp32, as torch's)
    optim.param_groups.<i>.<key>     the optimizer's hyper-parameters, ``params`` the group's names
    train_state.step                 zengine's global_steps (torchtitan's name); the LR scheduler's
    lr_scheduler.<key>, zengine.*    state; micro_steps, global_samples and client_state

An FSDP2 user continues with ``dcp.load({"model": msd, "optim": osd})`` and ``set_state_dict`` on
``get_state_dict(model, optim)``; zengine reads it back with ``load_checkpoint`` (reader.py). The save is
atomic as zengine's own (staging folder, rename, ``latest``) and runs in the background like them
(``async_save``): a snapshot to host memory, the plan agreed while the step waits, the files written by
a thread (writer.py).
"""

from __future__ import annotations

import base64
import os
import pickle
from typing import Any, Optional

import torch

from ..errors import CheckpointSaveError
from ..native import atomic, background, collectives, holdings, meta as meta_mod
from ..native.save import begin
from .boxes import flat_boxes
from .writer import DcpEntry, DcpWrite

MODEL, OPTIM = "model.", "optim."


def save_dcp_checkpoint(
    engine,
    save_dir: str,
    tag: Optional[str] = None,
    client_state: Optional[dict] = None,
    save_latest: bool = True,
    async_save: bool = False,
) -> bool:
    """Collective: write ``engine`` as a DCP checkpoint to ``save_dir/tag`` (see the module doc)."""
    tag, staging = begin(engine, save_dir, tag)
    group, rank = engine.optimizer.dp_group, engine.global_rank
    save, ready, error = None, None, None
    with engine.optimizer.states_resident():
        try:
            entries = engine_entries(engine)
            values = engine_values(engine, client_state) if rank == 0 else {}
            if async_save:  # the step goes on: write from a copy in host memory
                snapshot, ready = background.host_snapshot([(e.fqn, e.tensor) for e in entries])
                entries = [e._replace(tensor=t) for e, (_, t) in zip(entries, snapshot)]
            save = DcpWrite(staging, entries, values, rank)
        except Exception as e:  # reported on every rank below, before any rank plans
            error = f"rank {rank}: {type(e).__name__}: {e}"
    errors = [e for e in collectives.all_gather(error, group) if e]
    if not errors:
        try:
            save.plan(lambda local: collectives.all_gather(local, group))
        except Exception as e:  # the same plans on every rank: the same failure
            errors = [f"planning: {type(e).__name__}: {e}"]
    if errors:
        if rank == 0:
            atomic.discard(staging)
        raise CheckpointSaveError(
            f"save_checkpoint(checkpoint_format='dcp'): could not write checkpoint {tag!r} in "
            f"{save_dir}; the previous checkpoint and 'latest' are untouched:\n  "
            + "\n  ".join(errors)
        )

    def write() -> dict:
        if ready is not None:
            ready.synchronize()  # the device-to-host copies have landed
        return {"results": base64.b64encode(pickle.dumps(save.write())).decode()}

    def finish(posted: list[dict]) -> None:  # rank 0, once every rank wrote its file
        save.finish([pickle.loads(base64.b64decode(p["results"])) for p in posted])
        atomic.publish(staging, save_dir, tag, save_latest)

    ranks = collectives.group_ranks(group)
    job = background.BackgroundSave(
        os.path.basename(staging),
        rank,
        ranks,
        staging,
        save_dir,
        tag,
        write,
        finish if rank == 0 else None,
    )
    if async_save:
        background.track(engine, job.start())
    else:  # the same steps, waited for here
        job.start()
        job.wait()
    return True


def engine_entries(engine) -> list[DcpEntry]:
    """This rank's boxes: of the masters and their per-element states, of the untrained parameters,
    and (rank 0) the buffers. A tied name gets the boxes of its source again."""
    opt, rank, world = engine.optimizer, engine.global_rank, engine.world_size
    described = meta_mod.describe_model(engine.module, holdings.trained_names(opt))
    shapes = {n: tuple(p["shape"]) for n, p in described["params"].items()}
    names: dict[str, list[str]] = {}  # a parameter -> every state_dict key that is it
    for key, kind, source in described["state_dict"]:
        if kind == "param":
            names.setdefault(source, []).append(key)
    out: list[DcpEntry] = []

    def add(held: holdings.Holding, states: dict[str, torch.Tensor]) -> None:
        for p in held.pieces:
            for box in flat_boxes(shapes[p.name], p.start, p.end):
                at = p.offset + box.flat_start - p.start
                value = held.buffer.narrow(0, at, box.numel).view(box.sizes)
                out.extend(DcpEntry(MODEL + k, shapes[p.name], box, value) for k in names[p.name])
                for k, t in states.items():
                    state = t.narrow(0, at, box.numel).view(box.sizes)
                    out.append(DcpEntry(f"{OPTIM}state.{p.name}.{k}", shapes[p.name], box, state))

    for gi, master in enumerate(holdings.masters(opt, world, saving=True)):
        add(master, holdings.param_group_state(opt, gi))
    for held in holdings.untrained(engine.module, opt, rank, world, saving=True):
        add(held, {})
    if rank == 0:
        for name, b in holdings.buffers(engine.module).items():
            whole = flat_boxes(tuple(b.shape), 0, b.numel())
            out.extend(DcpEntry(MODEL + name, tuple(b.shape), box, b) for box in whole[:1])
        for gi, group in enumerate(opt.groups):
            for name, count in opt.step_counts.state_dict(gi).items():
                step = torch.tensor(float(count))
                out.append(DcpEntry(f"{OPTIM}state.{name}.step", (), flat_boxes((), 0, 1)[0], step))
    return out


def _torch_group(group: dict) -> dict:
    """An Adam-like group with the keys torch's AdamW has (what ``dcp.load`` into an FSDP2 optimizer asks
    for): zengine's CPU Adam and partial offload's keep fewer; those they lack take torch's defaults."""
    if "betas" not in group:
        return group
    defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    if "adamw_mode" in group:
        defaults["decoupled_weight_decay"] = bool(group["adamw_mode"])
    return {**defaults, **group}


def engine_values(engine, client_state: Optional[dict]) -> dict[str, Any]:
    """Rank 0's plain values: hyper-parameters and names of each optimizer group, the counters, the LR
    scheduler's state, client_state."""
    opt = engine.optimizer
    values: dict[str, Any] = {}
    names = holdings.param_group_names(opt)  # the user's param groups (sub-groups joined)
    for gi, group in enumerate(opt.optimizer.param_groups):
        base = f"{OPTIM}param_groups.{gi}."
        values.update({base + k: v for k, v in _torch_group(group).items() if k != "params"})
        values[base + "params"] = names[gi]
    values["train_state.step"] = engine.global_steps
    values["zengine.micro_steps"] = engine.micro_steps
    values["zengine.global_samples"] = engine.global_samples
    if engine.lr_scheduler is not None:
        values.update({f"lr_scheduler.{k}": v for k, v in engine.lr_scheduler.state_dict().items()})
    values["zengine.client_state"] = client_state if client_state is not None else {}
    return values
