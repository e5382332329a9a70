"""Loading a DCP checkpoint (FSDP2's, torchtitan's, or zengine's own DCP saves) into an engine.

``native/load.py`` opens a checkpoint through ``formats.open_reader``; a DCP folder is read by
``DcpReader``, which answers what ``CheckpointReader`` answers (a meta describing the model, ``fill`` of
any layout's pieces, buffers, the engine state), so the checks and the write-back are the same code at
any world size and stage. Each piece a rank holds is read as the whole rows that cover it
(``boxes.row_span``) through DCP's own reader and planner (``storage.py``): DCP reshards from the chunks
the saving ranks wrote, and a rank reads only the rows it needs.

What is taken from where (``sections.py`` finds the prefixes):

    model.<fqn> / <fqn>                   fp32 masters and untrained parameters (cast to the engine's
                                          dtypes), buffers; a tied name loads through its source
    <optim>.state.<fqn>.<key>             per-element states (exp_avg, exp_avg_sq, momentum_buffer...)
                                          and the per-parameter ``step``, zengine's step counts
    <optim>.param_groups.*                lr, betas, eps, weight_decay... of each group
    train_state.step                      torchtitan's step: the engine's global_steps (else the
                                          optimizer's largest step count)
    lr_scheduler.*                        torchtitan's scheduler state, given to the engine's scheduler
                                          when it is of the same kind
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..deepspeed.reader import _HYPER
from ..errors import CheckpointFileError
from ..native.holdings import Holding
from ..native.meta import dtype_name
from .boxes import row_span
from .sections import Sections, find_sections
from .storage import DcpFiles

_STEP = "step"
_COUNTERS = ("zengine.micro_steps", "zengine.global_samples")
_CLIENT = "zengine.client_state"


class DcpReader:
    """One DCP folder read as a zengine checkpoint (see the module doc). ``model``: the engine's
    ``meta.describe_model``, which says which saved keys are buffers and which are tied names."""

    def __init__(
        self,
        directory: str,
        trusted: bool,
        engine_groups: Sequence[Sequence[str]],
        gas: int,
        model: Optional[dict] = None,
    ):
        self.directory = directory
        self.files = DcpFiles(directory, trusted)
        self.groups = [list(g) for g in engine_groups]
        model = model or {"params": {}, "buffers": {}, "state_dict": []}
        rows = model["state_dict"] or [[n, "param", n] for n in model["params"]]
        tensors = self.files.tensors
        trained = [n for g in self.groups for n in g]
        self.sections: Sections = find_sections(
            tensors,
            self.files.values,
            [r[0] for r in rows],
            trained,
            self.files.metadata.planner_data,
        )
        if not self.sections.model:
            raise CheckpointFileError(
                f"DCP checkpoint {directory} holds none of the model's parameters "
                f"({', '.join([r[0] for r in rows][:3])}, ...) under any prefix"
            )
        self._source = {r[0]: r[2] for r in rows}  # state_dict key -> the parameter or buffer it is
        self._steps: Optional[dict[str, int]] = None
        self.meta = self._describe(model, gas)

    def __enter__(self) -> "DcpReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    # -- the meta -------------------------------------------------------------------------------
    def _describe(self, model: dict, gas: int) -> dict[str, Any]:
        tensors, ours = self.files.tensors, model["buffers"]
        trained = {n for g in self.groups for n in g}
        params, buffers, keys, fqn = {}, {}, [], {}
        for key, dcp_key in self.sections.model.items():
            source = self._source.get(key, key)
            if source != key and source in self.sections.model:
                continue  # a tied name: loaded through its source
            md = tensors[dcp_key]
            entry = {"shape": list(md.size), "dtype": dtype_name(md.properties.dtype)}
            fqn[source] = dcp_key
            if source in ours:
                buffers[source] = entry
            else:
                params[source] = {**entry, "trained": source in trained}
        for key, kind, source in model["state_dict"]:
            if source in fqn:
                keys.append([key, kind, source])
        self._fqn = fqn
        steps = self._train_step()
        if steps is None:
            steps = max(self.steps().values(), default=0)
        # what zengine's own DCP saves add (save.py)
        counters = self.files.read({}, [k for k in _COUNTERS if k in self.files.values])
        return {
            "format": "dcp",
            "params": params,
            "buffers": buffers,
            "state_dict": keys,
            "global_steps": steps,
            "micro_steps": int(counters.get("zengine.micro_steps", steps * gas)),
            "global_samples": int(counters.get("zengine.global_samples", 0)),
        }

    def _train_step(self) -> Optional[int]:
        """torchtitan's ``train_state.step`` (a value or a 0-d tensor), None when there is none."""
        key = "train_state.step"
        if key in self.files.tensors:
            out = torch.zeros((), dtype=self.files.tensors[key].properties.dtype)
            self.files.read({key: [(row_span((), 0, 1), out)]})
            return int(out)
        if key in self.files.values:
            return int(self.files.read({}, [key])[key])
        return None

    def steps(self) -> dict[str, int]:
        """Each trained parameter's optimizer step count (0 where it has no state)."""
        if self._steps is None:
            boxes, outs = {}, {}
            for name, found in self.sections.state.items():
                key = found.get(_STEP)
                if key in self.files.tensors:
                    outs[name] = torch.zeros((), dtype=self.files.tensors[key].properties.dtype)
                    boxes[key] = [(row_span((), 0, 1), outs[name])]
            values = [
                f[_STEP] for f in self.sections.state.values() if f.get(_STEP) in self.files.values
            ]
            loaded = self.files.read(boxes, values)
            self._steps = {n: int(t) for n, t in outs.items()}
            for name, found in self.sections.state.items():
                if found.get(_STEP) in loaded:
                    self._steps[name] = int(loaded[found[_STEP]])
        return self._steps

    # -- what native/load.py asks ---------------------------------------------------------------------
    def _key(self, kind: str, name: str) -> Optional[str]:
        if kind in ("master", "param"):
            return self._fqn.get(name)
        if kind.startswith("state."):
            return self.sections.state.get(name, {}).get(kind[len("state.") :])
        return None

    def fill(self, holding: Holding, kinds: Sequence[str], required: bool = True) -> None:
        """Fill each piece of ``holding`` from the first of ``kinds`` the checkpoint has for its
        parameter, in one DCP load: the rows covering each piece, then the piece's elements of them."""
        boxes: dict[str, list] = {}
        copies = []
        for piece in holding.pieces:
            key = next((k for k in (self._key(kind, piece.name) for kind in kinds) if k), None)
            if key is None or key not in self.files.tensors:
                if required:
                    raise CheckpointFileError(
                        f"DCP checkpoint {self.directory} has no {' or '.join(kinds)} for {piece.name}"
                    )
                holding.view(piece).zero_()
                continue
            md = self.files.tensors[key]
            box = row_span(md.size, piece.start, piece.end)
            rows = torch.empty(box.sizes, dtype=md.properties.dtype)
            boxes.setdefault(key, []).append((box, rows))
            copies.append((piece, rows, piece.start - box.flat_start))
        self.files.read(boxes)
        with torch.no_grad():
            for piece, rows, at in copies:
                holding.view(piece).copy_(rows.reshape(-1).narrow(0, at, piece.numel))

    def buffer_into(self, name: str, dst: torch.Tensor) -> None:
        dst.view(-1).copy_(self.read_buffer(name).reshape(-1))

    def read_buffer(self, name: str) -> torch.Tensor:
        key = self._fqn[name]
        md = self.files.tensors[key]
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        self.files.read({key: [(row_span(md.size, 0, out.numel()), out)]})
        return out

    def read_state(self, trusted: bool = False) -> dict[str, Any]:
        """The engine state in zengine's form: per optimizer group the hyper-parameters, the state keys,
        ``step`` and the per-parameter step counts; the LR scheduler when saved."""
        groups = [] if self.sections.optimizer is None else self._optimizer_groups()
        scheduler = self.sections.under("lr_scheduler.")
        return {
            "optimizer": groups,
            "lr_scheduler": _renamed(self.files.read({}, list(scheduler.values())), scheduler),
            "loss_scaler": {},
            "rng": [],
            "client_state": self.files.read({}, [_CLIENT]).get(_CLIENT, {})
            if _CLIENT in self.files.values
            else {},
        }

    def _optimizer_groups(self) -> list[dict]:
        steps = self.steps()
        hyper = self._hyper()
        out = []
        for gi, names in enumerate(self.groups):
            keys: list[str] = []
            for n in names:
                keys += [k for k in self.sections.state.get(n, {}) if k not in keys]
            if _STEP in keys:  # torch's optimizers keep step first
                keys.remove(_STEP)
                keys.insert(0, _STEP)
            counts = {n: steps.get(n, 0) for n in names}
            top = max(counts.values(), default=0)
            group: dict[str, Any] = {"hyper": hyper[gi], "keys": keys, "scalars": {}}
            if _STEP in keys:
                group["scalars"][_STEP] = torch.tensor(float(top))
                group["step_counts"] = counts
                group["flat_count"] = top
                group["scalars_by_count"] = {
                    c: {_STEP: torch.tensor(float(c))} for c in set(counts.values()) if c > 0
                }
            out.append(group)
        return out

    def _hyper(self) -> list[dict]:
        """Each engine group's saved hyper-parameters (those DeepSpeed's reader carries over too)."""
        lists = self.sections.group_lists()
        if lists:  # nested: param_groups.<i>.params names the group's parameters
            members = self.files.read({}, lists)
            owner = {n: i for i, k in enumerate(lists) for n in members[k]}
        out = []
        for names in self.groups:
            if lists:
                index = next((owner[n] for n in names if n in owner), None)
                keys = {} if index is None else self.sections.nested_hyper_keys(index)
            else:
                keys = self.sections.hyper_keys(names)
            keys = {k: v for k, v in keys.items() if k in _HYPER}
            out.append(_renamed(self.files.read({}, list(keys.values())), keys) or {})
        return out


def _renamed(loaded: dict[str, Any], keys: dict[str, str]) -> Optional[dict[str, Any]]:
    """{short key: value} from DCP keys; None when there are none."""
    if not keys:
        return None
    return {short: loaded[full] for short, full in keys.items()}
