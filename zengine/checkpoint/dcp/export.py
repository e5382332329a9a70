"""``zengine-convert to-dcp``: a zengine checkpoint rewritten as DCP, offline, in one process.

The same layout as ``save_checkpoint(..., checkpoint_format="dcp")`` (save.py): ``model.<key>`` whole in
fp32 (buffers as saved), ``optim.state.<fqn>.<key>`` and ``step``, ``optim.param_groups.<i>.*``, the
counters, LR scheduler and client_state. Any stage and world size saved it; FSDP2 loads the result at
any world size. The whole model and its optimizer states are held in memory once while written.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

from ..errors import CheckpointFileError
from ..native.holdings import Holding
from ..native.pieces import Piece
from ..native.reader import CheckpointReader, checkpoint_directory
from .boxes import flat_boxes
from .save import MODEL, OPTIM
from .writer import DcpEntry, write_offline


def export_dcp_checkpoint(
    checkpoint_dir: str, output_dir: str, tag: Optional[str] = None, trusted: bool = False
) -> str:
    """Write the zengine checkpoint ``checkpoint_dir`` (``tag`` default: ``latest``) as a DCP folder
    ``output_dir``; returns ``output_dir``. ``trusted``: state.pt may hold objects of your own classes."""
    if os.path.exists(output_dir) and os.listdir(output_dir):
        raise FileExistsError(f"to-dcp: {output_dir} exists and is not empty; name a new folder")
    with CheckpointReader(checkpoint_directory(checkpoint_dir, tag)) as reader:
        state = reader.read_state(trusted)
        entries, values = _entries(reader, state), _values(reader.meta, state)
    write_offline(output_dir, entries, values)
    return output_dir


def _whole(fqn: str, tensor: torch.Tensor) -> DcpEntry:
    shape = tuple(tensor.shape)
    return DcpEntry(fqn, shape, flat_boxes(shape, 0, max(tensor.numel(), 1))[0], tensor)


def _read(reader: CheckpointReader, name: str, kinds: tuple, required: bool) -> torch.Tensor:
    shape = reader.meta["params"][name]["shape"]
    out = torch.empty(math.prod(shape), dtype=torch.float32)
    reader.fill(Holding(out, [Piece(name, 0, out.numel(), 0)]), kinds, required)
    return out.view(shape)


def _entries(reader: CheckpointReader, state: dict) -> list[DcpEntry]:
    meta = reader.meta
    out, first = [], {}
    for key, kind, source in meta["state_dict"]:
        if (kind, source) not in first:
            first[(kind, source)] = (
                reader.read_buffer(source)
                if kind == "buffer"
                else _read(reader, source, ("master", "param"), True)
            )
        out.append(_whole(MODEL + key, first[(kind, source)]))
    for group in state["optimizer"] or []:
        counts = group.get("step_counts")
        if counts is None:
            raise CheckpointFileError(
                f"to-dcp: {reader.directory} predates per-parameter step counts; load it into an "
                "engine and save it again (save_checkpoint(..., checkpoint_format='dcp'))"
            )
        for name, count in counts.items():
            for k in group["keys"]:
                if k not in group["scalars"]:
                    t = _read(reader, name, (f"state.{k}",), False)
                    out.append(_whole(f"{OPTIM}state.{name}.{k}", t))
            out.append(_whole(f"{OPTIM}state.{name}.step", torch.tensor(float(count))))
    return out


def _values(meta: dict, state: dict) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for gi, group in enumerate(state["optimizer"] or []):
        base = f"{OPTIM}param_groups.{gi}."
        values.update({base + k: v for k, v in group["hyper"].items()})
        values[base + "params"] = list(group.get("step_counts") or {})
    values["train_state.step"] = meta["global_steps"]
    values["zengine.micro_steps"] = meta["micro_steps"]
    values["zengine.global_samples"] = meta["global_samples"]
    for k, v in (state.get("lr_scheduler") or {}).items():
        values[f"lr_scheduler.{k}"] = v
    values["zengine.client_state"] = state.get("client_state") or {}
    return values
