"""DeepSpeed's universal checkpoints (``python -m deepspeed.checkpoint.ds_to_universal``), loaded with
``checkpoint.load_universal: true`` (DeepSpeed's key) at any stage and world size.

What ds_to_universal writes into ``<save_dir>/<tag>_universal/`` (and the tag into
``<save_dir>/latest_universal``):

    zero/<param>/fp32.pt                   the parameter's fp32 master, whole (a tensor, or a dict whose
    zero/<param>/exp_avg.pt, exp_avg_sq.pt ``param`` is one; ``vocab_tensor``: rows padded or cut to
    zero/<param>/step.pt (some versions)   the model's); Adam's moments likewise; a per-parameter step
    zero/optimizer_state.pt                rank 0's optimizer file less its flat tensors: the ZeRO stage,
                                           partition count, param_groups (hyper-parameters, ``step``),
                                           loss scaler
    *_model_states.pt                      copied from the ZeRO checkpoint: the module's buffers, frozen
                                           parameters (their fragments at stage 3), tied names, the LR
                                           scheduler, counters, client_state

``UniversalReader`` is a DeepSpeedReader whose trained parameters come from those per-parameter files
instead of the ranks' flat partitions: each parameter is one whole source, so any layout's pieces fill
from it; the frozen parameters, buffers, meta and engine state are read as from the ZeRO checkpoint.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

from ..errors import CheckpointFileError, CheckpointMismatchError
from .files import load_ds_file
from .reader import _ENGINE_KEYS, _HYPER, DeepSpeedReader, _loss_scaler

ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
LATEST_UNIVERSAL = "latest_universal"
MASTER_FILE = "fp32"


def is_universal_checkpoint(directory: str) -> bool:
    """Whether ``directory`` is ds_to_universal's output (its ``zero/optimizer_state.pt``)."""
    return os.path.isfile(os.path.join(directory, ZERO, OPTIMIZER_STATE))


def universal_tag(load_dir: str) -> Optional[str]:
    """The tag in ``load_dir/latest_universal``, None without one."""
    try:
        with open(os.path.join(load_dir, LATEST_UNIVERSAL)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _whole(value, name: str, shape: Sequence[int], path: str) -> torch.Tensor:
    """A per-parameter file's tensor as ``shape``: a vocabulary tensor's rows padded with zeros or cut
    (DeepSpeed's own restore does the same); any other size is refused by name."""
    vocab = isinstance(value, dict) and bool(value.get("vocab_tensor"))
    tensor = value["param"] if isinstance(value, dict) else value
    if not torch.is_tensor(tensor):
        raise CheckpointFileError(f"universal checkpoint file {path} holds no tensor")
    tensor = tensor.detach()
    numel = math.prod(shape)
    if tensor.numel() == numel:
        return tensor.reshape(-1)
    if vocab and shape and tensor.numel() % max(1, math.prod(shape[1:])) == 0:
        rows = tensor.reshape(-1, *shape[1:])
        if rows.shape[0] > shape[0]:
            return rows[: shape[0]].reshape(-1)
        pad = torch.zeros((shape[0] - rows.shape[0], *shape[1:]), dtype=rows.dtype)
        return torch.cat([rows, pad]).reshape(-1)
    raise CheckpointMismatchError(
        f"universal checkpoint file {path} holds {tensor.numel()} elements for {name} of shape "
        f"{tuple(shape)}"
    )


class UniversalReader(DeepSpeedReader):
    """ds_to_universal's folder read as a zengine checkpoint (see the module doc)."""

    def __init__(
        self, directory: str, trusted: bool, engine_groups: Sequence[Sequence[str]], gas: int
    ):
        self.directory = directory
        names = sorted(os.listdir(directory))
        path = os.path.join(directory, ZERO, OPTIMIZER_STATE)
        try:
            common = load_ds_file(path, trusted)
        except Exception as e:
            raise CheckpointFileError(
                f"universal checkpoint file {path} is unreadable: {e}"
            ) from None
        count = common.get("partition_count", 1)
        self.world = max(count) if isinstance(count, list) else int(count)
        self._optim = [common]
        self.layout = self._layout()
        # stage 3 keeps the torch optimizer's state_dict (with step); stages 1-2 its param_groups alone
        wrapped = common.get(self.layout.optimizer_key) or {}
        self._param_groups = wrapped.get("param_groups") or common.get("param_groups") or []
        first = (wrapped.get("state") or {}).get(0, {})
        self._common_step = int(first["step"]) if "step" in first else None
        self._models = self._model_states(names, trusted)
        self._check_parallel(self._models[0])
        self._flats, self._index, self._offsets = {}, {}, {}
        self._ds_groups = self._read_params(self._models[0]["param_shapes"])
        self._frozen = self._frozen_values()
        self._engine_groups = engine_groups
        self.meta = {**self._describe(self._models[0], gas), "format": "deepspeed-universal"}

    def _read_params(self, param_shapes: list) -> list[list[str]]:
        """Each trained parameter's files, whole: one source per parameter (the reader's ``rank`` is
        the parameter's number here), ``master`` and ``state.<key>``; the groups' names."""
        groups_of = self._flat_to_group(self._param_groups, len(param_shapes))
        names_by_group: list[list[str]] = [[] for _ in range(max(groups_of, default=-1) + 1)]
        self._param_steps: dict[str, int] = {}
        source = 0
        for g, shapes in enumerate(param_shapes):
            for name, shape in shapes.items():
                folder = os.path.join(self.directory, ZERO, name)
                files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
                if f"{MASTER_FILE}.pt" not in files:
                    raise CheckpointFileError(
                        f"universal checkpoint {self.directory} lacks {ZERO}/{name}/{MASTER_FILE}.pt"
                    )
                flats = {}
                for file in files:
                    key, path = file[: -len(".pt")], os.path.join(folder, file)
                    value = load_ds_file(path)
                    if key == "step":
                        self._param_steps[name] = int(value)
                        continue
                    kind = "master" if key == MASTER_FILE else f"state.{key}"
                    flats[kind] = _whole(value, name, list(shape), path).float()
                self._flats[(source, g)] = flats
                self._index[name] = [(source, g, 0, math.prod(shape))]
                self._offsets[(source, g, name)] = 0
                names_by_group[groups_of[g]].append(name)
                source += 1
        return names_by_group

    def read_state(self, trusted: bool = False) -> dict:
        """The engine state in zengine's form: per group the hyper-parameters, the state keys the
        per-parameter files hold and each parameter's step; the LR scheduler, loss scale, client_state."""
        self._check_groups(self._engine_groups)
        groups = []
        for gi, group in enumerate(self._param_groups):
            names = self._ds_groups[gi] if gi < len(self._ds_groups) else []
            keys = ["step"]
            for n in names:
                for kind in self._flats[(self._index[n][0][0], self._index[n][0][1])]:
                    if kind.startswith("state.") and kind[6:] not in keys:
                        keys.append(kind[6:])
            counts = {n: self._param_steps.get(n, self._common_step or 0) for n in names}
            top = max(counts.values(), default=0)
            groups.append(
                {
                    "hyper": {k: group[k] for k in _HYPER if k in group},
                    "keys": keys,
                    "scalars": {"step": torch.tensor(float(top))},
                    "step_counts": counts,
                }
            )
        common = self._models[0]
        return {
            "optimizer": groups,
            "lr_scheduler": common.get("lr_scheduler"),
            "loss_scaler": _loss_scaler(self._optim[0].get("loss_scaler")),
            "rng": [],
            "client_state": {k: v for k, v in common.items() if k not in _ENGINE_KEYS},
        }
