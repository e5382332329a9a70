"""The way back to DeepSpeed: a zengine checkpoint rewritten in DeepSpeed 0.19's ZeRO layout, offline.

``export_deepspeed_checkpoint(zengine_dir, save_dir, world_size, ds_config)`` writes
``save_dir/<tag>/`` and ``save_dir/latest`` as DeepSpeed's ``save_checkpoint`` would have for
``world_size`` ranks running ``ds_config`` (its ZeRO stage, bf16/fp16, bf16 gradient accumulation
dtype): the fp32 masters and the optimizer's per-element states cut into DeepSpeed's flat partitions
(partition.py, layout.py: the same rules the reader uses), the optimizer's hyper-parameters and
``step``, the module's state_dict in the 16-bit dtype, tied names, frozen parameters, LR scheduler,
counters and client_state. DeepSpeed then continues with ``engine.load_checkpoint(save_dir)`` on
that many ranks (it cannot change the world size of a ZeRO checkpoint itself). DeepSpeed's own
objects in the files (loss scaler, ZeRO stage) are written under DeepSpeed's class names without
DeepSpeed installed (files.py); DeepSpeed takes the file's loss scaler for its own, so an fp16
config gets a dynamic one built from its fp16 section (with zengine's scale and counters when
zengine trained in fp16 with a dynamic scale).

The flat order of each group is the order of the engine's optimizer group, which is the order of the
param group given to ``initialize``: DeepSpeed builds the same order from the same param groups
(``round_robin_gradients`` and ``parameter_alignment`` off, their defaults; both are refused here).
"""

from __future__ import annotations

import math
import os
import shutil
from collections import OrderedDict
from functools import partial
from typing import Any, Optional

import torch

from .files import make, save_ds_file
from .layout import DS_VERSION, DeepSpeedLayout, FlatGroup, OptimizerParts, layout_for
from ..native.holdings import Holding
from ..native.pieces import Piece
from ..native.reader import CheckpointReader, checkpoint_directory

_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
_DYNAMIC_SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class DeepSpeedExportError(ValueError):
    """The export cannot write what DeepSpeed would load for the given config; the message says why."""


def _target(ds_config: dict) -> tuple[int, torch.dtype, bool]:
    """(stage, 16-bit or fp32 module dtype, whether DeepSpeed's bf16 optimizer would run)."""
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        raise DeepSpeedExportError(
            f"export_deepspeed_checkpoint: ZeRO stage {stage} in the config; DeepSpeed's "
            f"ZeRO layout exists for stages 1, 2 and 3"
        )
    for key in ("round_robin_gradients", "parameter_alignment"):
        if zero.get(key):
            raise DeepSpeedExportError(
                f"export_deepspeed_checkpoint: zero_optimization.{key} reorders or pads "
                f"DeepSpeed's flat groups; run DeepSpeed without it to load this export"
            )
    bf16 = bool((ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"))
    fp16 = bool((ds_config.get("fp16") or {}).get("enabled"))
    accumulate = str((ds_config.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
    bf16_optimizer = (
        bf16 and stage == 1 and accumulate in ("fp32", "float32", "float", "torch.float32")
    )
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    return stage, dtype, bf16_optimizer


def export_deepspeed_checkpoint(
    checkpoint_dir: str,
    save_dir: str,
    world_size: int,
    ds_config: dict,
    tag: Optional[str] = None,
    out_tag: Optional[str] = None,
    trusted: bool = False,
) -> str:
    """Write the zengine checkpoint ``checkpoint_dir`` (``tag`` default: ``latest``) as DeepSpeed's
    ``save_dir/<out_tag>`` (default ``global_step<N>``) for ``world_size`` ranks running ``ds_config``;
    returns that directory. ``trusted``: state.pt may hold objects a weights-only load refuses."""
    stage, dtype, bf16_optimizer = _target(ds_config)
    layout = layout_for(stage, bf16_optimizer, world_size)
    directory = checkpoint_directory(checkpoint_dir, tag)
    with CheckpointReader(directory) as reader:
        state = reader.read_state(trusted)
        meta = reader.meta
        out_tag = str(out_tag) if out_tag is not None else f"global_step{meta['global_steps']}"
        final = os.path.join(save_dir, out_tag)
        staging = os.path.join(save_dir, f".tmp-export-{out_tag}")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            _Writer(reader, state, ds_config, layout, dtype).write(staging)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(out_tag)
    return final


class _Writer:
    """The files of one export (see the module doc)."""

    def __init__(
        self,
        reader: CheckpointReader,
        state: dict,
        ds_config: dict,
        layout: DeepSpeedLayout,
        dtype: torch.dtype,
    ):
        self.reader, self.state, self.config = reader, state, ds_config
        self.layout, self.world, self.dtype = layout, layout.world, dtype
        self.meta = reader.meta
        self.groups = [list(g.get("step_counts") or {}) for g in state["optimizer"]]
        trained = [n for n, p in self.meta["params"].items() if p["trained"]]
        if sorted(n for g in self.groups for n in g) != sorted(trained):
            raise DeepSpeedExportError(
                f"export_deepspeed_checkpoint: {reader.directory} does not record which "
                f"parameters each optimizer group holds (saved by an older zengine); save "
                f"it again with this version"
            )
        self.numels = [[math.prod(self.meta["params"][n]["shape"]) for n in g] for g in self.groups]
        sub_group = int((ds_config.get("zero_optimization") or {}).get("sub_group_size", 1e9))
        if any(layout.splits_group(n, sub_group) for n in self.numels):
            raise DeepSpeedExportError(
                f"export_deepspeed_checkpoint: a group has more than sub_group_size "
                f"({sub_group}) elements: DeepSpeed would cut it into sub-groups, which "
                f"this export does not write; raise zero_optimization.sub_group_size"
            )

    def _filled(
        self, numel: int, pieces: list, kinds: tuple, required: bool = True
    ) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32)
        self.reader.fill(Holding(out, pieces), kinds, required)
        return out

    def _optimizer_file(self, rank: int) -> dict[str, Any]:
        masters, states, paddings, groups = [], {}, [], []
        for g, saved in enumerate(self.state["optimizer"]):
            part = self.layout.write_partition(FlatGroup(self.groups[g], self.numels[g]), rank)
            masters.append(self._filled(part.numel, part.pieces, ("master", "param")))
            paddings.append(part.padding)
            entry = {}
            for key in saved["keys"]:
                if key in saved["scalars"]:
                    value = saved["scalars"][key]
                    entry[key] = value.clone() if torch.is_tensor(value) else value
                else:
                    entry[key] = self._filled(
                        part.moments, part.pieces, (f"state.{key}",), required=False
                    )
            if entry and "step" not in entry and saved.get("step_counts"):
                entry = {"step": torch.tensor(float(max(saved["step_counts"].values()))), **entry}
            states[g] = entry
            groups.append({**saved["hyper"], "params": [g]})
        optimizer = {"state": {g: s for g, s in states.items() if s}, "param_groups": groups}
        scaler = self._loss_scaler()
        sd = self.layout.optimizer_state(
            OptimizerParts(
                optimizer,
                masters,
                paddings,
                [len(g) for g in self.groups],
                scaler,
                dynamic=scaler.ds_class == _DYNAMIC_SCALER,
                clip_grad=float(self.config.get("gradient_clipping", 0.0)),
            )
        )
        return {"optimizer_state_dict": sd, "ds_config": self.config, "ds_version": DS_VERSION}

    def _loss_scaler(self):
        """DeepSpeed's scaler for the target precision (it replaces its own with the one in the file): a
        static scale, or fp16's dynamic one carrying zengine's scale and counters when it had them."""
        fp16 = self.config.get("fp16") or {}
        saved = self.state.get("loss_scaler") or {}
        if not fp16.get("enabled") or fp16.get("loss_scale", 0) > 0:
            return make(
                _LOSS_SCALER, cur_scale=float(fp16.get("loss_scale", 0) or 1.0), dynamic=False
            )
        dynamic = (
            "iteration" in saved
        )  # zengine trained in fp16 with a dynamic scale: carry it over
        hysteresis = int(fp16.get("hysteresis", 2))
        return make(
            _DYNAMIC_SCALER,
            cur_scale=float(saved["scale"])
            if dynamic
            else 2.0 ** fp16.get("initial_scale_power", 16),
            cur_iter=int(saved.get("iteration", 0)),
            last_overflow_iter=int(saved.get("last_overflow_iteration", -1)),
            scale_factor=2.0,
            scale_window=int(fp16.get("loss_scale_window", 1000)),
            min_scale=float(fp16.get("min_loss_scale", 1)),
            delayed_shift=hysteresis,
            cur_hysteresis=int(saved.get("hysteresis_left", hysteresis)),
            consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
            raise_error_at_min_scale=True,
            dynamic=True,
            dtype=torch.float16,
        )

    def _whole(self, name: str) -> torch.Tensor:
        entry = self.meta["params"][name]
        numel = math.prod(entry["shape"])
        return self._filled(numel, [Piece(name, 0, numel, 0)], ("master", "param")).view(
            entry["shape"]
        )

    def _model_file(self, rank: int) -> dict[str, Any]:
        module: OrderedDict = OrderedDict()
        first: dict[tuple[str, str], str] = {}
        shared = {}
        for key, kind, source in self.meta["state_dict"]:
            if kind == "buffer":
                module[key] = self.reader.read_buffer(source)
                continue
            if ("param", source) in first:
                shared[key] = source
            first.setdefault(("param", source), key)
            whole = partial(self._whole_in_dtype, source)
            module[key] = self.layout.module_entry(whole, self.dtype)
        frozen = OrderedDict(
            (n, torch.Size(p["shape"])) for n, p in self.meta["params"].items() if not p["trained"]
        )
        shapes, fragments = self.layout.frozen_records(frozen, self._whole_in_dtype, rank)
        state = self.state
        out = {
            "module": module,
            "buffer_names": [k for k, kind, _ in self.meta["state_dict"] if kind == "buffer"],
            "optimizer": None,
            "param_shapes": [
                OrderedDict((n, torch.Size(self.meta["params"][n]["shape"])) for n in g)
                for g in self.groups
            ],
            "frozen_param_shapes": shapes,
            "shared_params": shared,
            "frozen_param_fragments": fragments,
            "lr_scheduler": state.get("lr_scheduler"),
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,
            "global_steps": self.meta["global_steps"],
            "global_samples": self.meta["global_samples"],
            "dp_world_size": self.world,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": self.config,
            "ds_version": DS_VERSION,
        }
        out.update(state.get("client_state") or {})
        return out

    def _whole_in_dtype(self, name: str) -> torch.Tensor:
        return self._whole(name).to(self.dtype)

    def write(self, directory: str) -> None:
        prefix = (
            "bf16_" if self.dtype == torch.bfloat16 else ""
        )  # DeepSpeed names them by the bf16 flag
        for rank in range(self.world):
            save_ds_file(
                self._optimizer_file(rank),
                os.path.join(directory, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
            )
        for rank, name in enumerate(self.layout.model_files()):
            save_ds_file(self._model_file(rank), os.path.join(directory, name))
