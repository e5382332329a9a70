"""Loading a checkpoint that DeepSpeed wrote: ``engine.load_checkpoint(ds_save_dir, tag)`` as with zengine's own.

``native/load.py`` opens its checkpoint through ``open_reader``: a directory without zengine's ``meta.json`` that
holds DeepSpeed's files is read by ``DeepSpeedReader``, which answers what ``CheckpointReader`` answers (a
meta describing the model, ``fill`` of any layout's pieces, buffers, the engine state), so the rest of the
load (checks before any state changes, then the write-back) is the same code at any world size and stage.

What DeepSpeed 0.19 writes into ``save_dir/<tag>/`` and what is taken from it:

    mp_rank_00_model_states.pt             stages 1-2: the module's state_dict (its frozen parameters at
                                           stage 1, the buffers), ``param_shapes`` (the trained parameters,
                                           per flat group, in flat order), ``shared_params`` (tied names),
                                           ``frozen_param_shapes``/``_fragments`` (stage 2), the LR scheduler,
                                           ``global_steps``/``global_samples``, and the client_state keys
    zero_pp_rank_R_mp_rank_00_model_states.pt
                                           stage 3: the same per rank R, its chunks of the frozen parameters
    zero_pp_rank_R_mp_rank_00_optim_states.pt
                                           rank R's flat fp32 masters and the wrapped torch optimizer's state
                                           (Adam's exp_avg/exp_avg_sq shaped like them, ``step``); the loss
                                           scaler; named ``bf16_zero_pp_rank_*`` when bf16 was on (then at
                                           stage 1 with fp32 gradient accumulation DeepSpeed's bf16 optimizer
                                           wrote them: no ZeRO stage recorded, partitions kept padded)

Element positions follow partition.py and layout.py. Model-parallel (``mp_rank_01``), pipeline
(``layer_*``) and MoE (``expp_rank_*``, ``*expert_*``) checkpoints, and a DeepSpeed group that does
not hold the same parameters as the engine's group of the same index, are refused by name before
anything is loaded. DeepSpeed's own objects in the files are read as plain data without DeepSpeed
installed (files.py).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Optional, Sequence

import torch

from .files import load_ds_file
from .layout import DeepSpeedLayout, FlatGroup, layout_for
from ..errors import CheckpointFileError, CheckpointMismatchError
from ..native.holdings import Holding
from ..native.meta import META, dtype_name
from ..native.pieces import overlaps
from ..native.reader import CheckpointReader

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
# the keys DeepSpeed's engine writes into the model states file; the others are the user's client_state
_ENGINE_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
}
# optimizer hyper-parameters carried over; device choices (foreach, fused, capturable) stay this engine's
_HYPER = (
    "lr",
    "initial_lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "momentum",
    "dampening",
    "nesterov",
    "bias_correction",
)


class DeepSpeedCheckpointError(CheckpointMismatchError):
    """A DeepSpeed checkpoint zengine cannot load: model or pipeline parallel, MoE, or optimizer groups
    that hold other parameters than the engine's; the message names what and the way out."""


def is_deepspeed_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds DeepSpeed's files and no zengine ``meta.json``."""
    if os.path.exists(os.path.join(directory, META)) or not os.path.isdir(directory):
        return False
    return any(
        name.endswith(("_optim_states.pt", "_model_states.pt")) for name in os.listdir(directory)
    )


def open_reader(directory: str, trusted: bool, engine_groups: Sequence[Sequence[str]], gas: int):
    """The reader for ``directory``: zengine's own, or a DeepSpeedReader for DeepSpeed's layout."""
    if is_deepspeed_checkpoint(directory):
        return DeepSpeedReader(directory, trusted, engine_groups, gas)
    return CheckpointReader(directory)


def _model_parallel_rank(name: str) -> Optional[int]:
    match = _OPTIM.fullmatch(name) or _MODEL.fullmatch(name)
    return int(match.group(match.lastindex)) if match else None


def _refuse_unsupported(directory: str, names: list[str]) -> None:
    """Model-parallel, pipeline and MoE checkpoints: refused by name before anything is read."""
    other_mp = [n for n in names if _model_parallel_rank(n) not in (None, 0)]
    pipeline = [n for n in names if n.startswith("layer_") and "_expert_" not in n]
    moe = [n for n in names if n.startswith("expp_rank_") or "_expert_" in n]
    for found, what in (
        (other_mp, "tensor (model) parallel ranks other than mp_rank_00"),
        (pipeline, "pipeline-parallel layer files"),
        (moe, "mixture-of-experts files"),
    ):
        if found:
            raise DeepSpeedCheckpointError(
                f"DeepSpeed checkpoint {directory} has {what} ({', '.join(found[:4])}): zengine loads data-parallel "
                f"ZeRO checkpoints (one mp_rank_00). Consolidate it with DeepSpeed's own tools first "
                f"(ds_to_universal.py, zero_to_fp32.py) and load the weights with load_state_dict"
            )


class DeepSpeedReader:
    """One DeepSpeed checkpoint directory, read as a zengine checkpoint (see the module doc)."""

    def __init__(
        self, directory: str, trusted: bool, engine_groups: Sequence[Sequence[str]], gas: int
    ):
        self.directory = directory
        names = sorted(os.listdir(directory))
        _refuse_unsupported(directory, names)
        optim = {
            int(m.group(2)): (n, bool(m.group(1))) for n in names if (m := _OPTIM.fullmatch(n))
        }
        if not optim or sorted(optim) != list(range(len(optim))):
            raise CheckpointFileError(
                f"DeepSpeed checkpoint {directory}: expected zero_pp_rank_<r>_mp_rank_00_optim_"
                f"states.pt for ranks 0..N-1, found {[n for n, _ in optim.values()] or 'none'}"
            )
        if len({bf16 for _, bf16 in optim.values()}) > 1:
            raise CheckpointFileError(
                f"DeepSpeed checkpoint {directory} mixes bf16_zero_pp_rank_* and zero_pp_rank_* "
                f"files (two saves into one tag?); remove the stale ones"
            )
        self.world = len(optim)
        self._optim = [
            load_ds_file(os.path.join(directory, optim[r][0]))["optimizer_state_dict"]
            for r in range(self.world)
        ]
        self.layout = self._layout()
        self._models = self._model_states(names, trusted)
        common = self._models[0]
        self._check_parallel(common)
        self._flats: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._index: dict[
            str, list[tuple[int, int, int, int]]
        ] = {}  # name -> [(rank, group, start, end)]
        self._offsets: dict[tuple[int, int, str], int] = {}
        self._ds_groups = self._build_index(common["param_shapes"])
        self._frozen = self._frozen_values()
        self._engine_groups = engine_groups
        self.meta = self._describe(common, gas)

    def __enter__(self) -> "DeepSpeedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._flats.clear()
        self._optim, self._models = [], []

    @property
    def stage(self) -> int:
        """The ZeRO stage DeepSpeed saved at (1 for its bf16 optimizer)."""
        return self.layout.stage

    # -- reading the files ------------------------------------------------------------------
    def _layout(self) -> DeepSpeedLayout:
        sd = self._optim[0]
        # the bf16_ prefix says bf16 was on; DeepSpeed's bf16 optimizer (stage 1 with fp32
        # gradient accumulation) is the one writer that records no ZeRO stage
        bf16_optimizer = "zero_stage" not in sd
        stage = (
            int(sd["zero_stage"]) if "zero_stage" in sd else 1
        )  # the bf16 optimizer: stage 1's layout
        if stage not in (1, 2, 3):
            raise DeepSpeedCheckpointError(
                f"DeepSpeed checkpoint {self.directory}: ZeRO stage {stage} is not one "
                f"zengine reads (1, 2 or 3)"
            )
        count = sd.get("partition_count")
        counts = set(count) if isinstance(count, list) else {count}
        if counts != {self.world}:
            raise CheckpointFileError(
                f"DeepSpeed checkpoint {self.directory} was partitioned over {sorted(counts)} "
                f"ranks but holds {self.world} optim_states files: some are missing or stale"
            )
        return layout_for(stage, bf16_optimizer, self.world)

    def _model_states(self, names: list[str], trusted: bool) -> list[dict]:
        files = self.layout.model_files()
        missing = [f for f in files if f not in names]
        if missing:
            raise CheckpointFileError(
                f"DeepSpeed checkpoint {self.directory} lacks {', '.join(missing)}"
            )
        return [load_ds_file(os.path.join(self.directory, f), trusted) for f in files]

    def _check_parallel(self, common: dict) -> None:
        dims = common.get("checkpoint_parallel_dimensions") or {}
        mp = common.get("mp_world_size", 1)
        if mp != 1 or dims.get("pp_degree", 1) != 1 or dims.get("tp_degree", 1) != 1:
            raise DeepSpeedCheckpointError(
                f"DeepSpeed checkpoint {self.directory} was saved with model parallel size {mp}, pipeline degree "
                f"{dims.get('pp_degree', 1)}, tensor degree {dims.get('tp_degree', 1)}: zengine loads data-parallel "
                f"ZeRO checkpoints only; convert it with DeepSpeed's ds_to_universal.py or zero_to_fp32.py first"
            )
        if common.get("param_shapes") is None:
            raise DeepSpeedCheckpointError(
                f"DeepSpeed checkpoint {self.directory} has no param_shapes: it was not "
                f"saved by a ZeRO engine (stage 0 keeps its optimizer in another form)"
            )

    # -- where each element is ---------------------------------------------------------------
    def _build_index(self, param_shapes: list) -> list[list[str]]:
        """Fill the per-rank flat tensors and the element index; returns the names of each optimizer group."""
        key, base = self.layout.masters_key, self.layout.optimizer_key
        groups_of = self._flat_to_group(self._optim[0][base]["param_groups"], len(param_shapes))
        names_by_group: list[list[str]] = [[] for _ in range(max(groups_of, default=-1) + 1)]
        for g, shapes in enumerate(param_shapes):
            paddings = self._optim[0].get("param_alignment_paddings", [None] * len(param_shapes))[g]
            group = FlatGroup(list(shapes), [math.prod(s) for s in shapes.values()], paddings)
            names_by_group[groups_of[g]] += group.names
            for rank, sd in enumerate(self._optim):
                master = (
                    sd[key][g].detach().view(-1)
                )  # DeepSpeed saves its masters with requires_grad
                # torch numbers its state by parameter across groups: here one flat tensor each, in flat order
                state = sd[base]["state"].get(g, {})
                pieces = self.layout.read_pieces(self.directory, g, group, rank, master.numel(), sd)
                flats = {"master": master}
                flats.update(
                    {
                        f"state.{k}": v.detach().view(-1)
                        for k, v in state.items()
                        if torch.is_tensor(v) and v.dim() > 0 and v.numel() >= master.numel()
                    }
                )
                self._flats[(rank, g)] = flats
                for p in pieces:
                    self._index.setdefault(p.name, []).append((rank, g, p.start, p.end))
                    self._offsets[(rank, g, p.name)] = p.offset
        return names_by_group

    @staticmethod
    def _flat_to_group(param_groups: list[dict], flats: int) -> list[int]:
        """The torch optimizer group of each flat tensor (stage 3 may cut a group into sub-groups)."""
        owner = {i: gi for gi, g in enumerate(param_groups) for i in g["params"]}
        return [owner.get(i, i) for i in range(flats)]

    def _frozen_values(self) -> dict[str, torch.Tensor]:
        """Parameters outside the optimizer, whole, in the dtype DeepSpeed kept them."""
        common = self._models[0]
        trained = set(self._index)
        shapes = common.get("frozen_param_shapes")
        if shapes is not None:
            return self.layout.frozen_values(self._models, shapes)
        skip = (
            trained | set(common.get("buffer_names") or []) | set(common.get("shared_params") or {})
        )
        return {n: t.reshape(-1) for n, t in common["module"].items() if n not in skip}

    def _check_groups(self, engine_groups: Sequence[Sequence[str]]) -> None:
        """DeepSpeed's group i must hold the engine's group i, less what only one of them trains (a parameter
        frozen on one side loads as a parameter, without optimizer state)."""
        trained_here = {n for g in engine_groups for n in g}
        ds = [set(g) & trained_here for g in self._ds_groups]
        ours = [set(g) & set(self._index) for g in engine_groups]
        if ds == ours:
            return
        rows = [
            f"group {i}: DeepSpeed {self._ds_groups[i] if i < len(ds) else '-'}, engine "
            f"{list(engine_groups[i]) if i < len(ours) else '-'}"
            for i in range(max(len(ds), len(ours)))
        ]
        raise DeepSpeedCheckpointError(
            f"DeepSpeed checkpoint {self.directory}: its optimizer groups hold other parameters than the engine's; "
            f"build the optimizer with the same param groups, in the same order, as the DeepSpeed run did:\n  "
            + "\n  ".join(rows)
        )

    def _describe(self, common: dict, gas: int) -> dict[str, Any]:
        params: dict[str, dict] = {}
        for shapes in common["param_shapes"]:
            for n, s in shapes.items():
                params[n] = {"shape": list(s), "dtype": "float32", "trained": True}
        for n, t in self._frozen.items():
            shape = (common.get("frozen_param_shapes") or {}).get(
                n, common["module"].get(n, t).shape
            )
            params[n] = {"shape": list(shape), "dtype": dtype_name(t.dtype), "trained": False}
        buffers = {
            n: {
                "shape": list(common["module"][n].shape),
                "dtype": dtype_name(common["module"][n].dtype),
            }
            for n in common.get("buffer_names") or []
        }
        # the module's state_dict keys in order, a tied name pointing at the parameter DeepSpeed stored
        shared = dict(common.get("shared_params") or {})
        buffer_names = set(buffers)
        keys = [
            [k, "buffer" if k in buffer_names else "param", shared.get(k, k)]
            for k in common["module"]
            if k in buffer_names or shared.get(k, k) in params
        ]
        steps = int(common.get("global_steps", 0))
        return {
            "format": "deepspeed",
            "ds_version": common.get("ds_version"),
            "zero_stage": self.layout.stage,
            "world_size": self.world,
            "params": params,
            "buffers": buffers,
            "global_steps": steps,
            "micro_steps": steps * gas,
            "global_samples": int(common.get("global_samples", 0)),
            "skipped_steps": int(common.get("skipped_steps", 0)),
            "shared_params": shared,
            "state_dict": keys,
        }

    # -- what native/load.py asks ---------------------------------------------------------------------
    def fill(self, holding: Holding, kinds: Sequence[str], required: bool = True) -> None:
        """Fill each piece of ``holding`` from the first of ``kinds`` the checkpoint has for its parameter:
        ``master`` and ``state.<key>`` from the ranks' flat tensors, ``param`` from a frozen parameter."""
        with torch.no_grad():  # the engine's buffers must not enter a graph through a loaded tensor
            for piece in holding.pieces:
                self._fill_piece(holding, piece, kinds, required)

    def _fill_piece(self, holding: Holding, piece, kinds: Sequence[str], required: bool) -> None:
        sources = self._sources(piece, kinds)
        found = sum(hi - lo for _, lo, hi, _ in sources)
        if found != piece.numel:
            if required:
                raise CheckpointFileError(
                    f"DeepSpeed checkpoint {self.directory} holds {found} of the "
                    f"{piece.numel} elements [{piece.start}, {piece.end}) of {piece.name}"
                )
            holding.view(piece).zero_()
        for src, lo, hi, at in sources:
            holding.view(piece).narrow(0, at, hi - lo).copy_(src.narrow(0, lo, hi - lo))

    def _sources(self, piece, kinds: Sequence[str]) -> list:
        for kind in kinds:
            if kind == "param":
                if piece.name in self._frozen:
                    whole = self._frozen[piece.name]
                    return [
                        (whole, lo, hi, at)
                        for _, lo, hi, at in overlaps(piece, [(0, 0, whole.numel())])
                    ]
                continue
            entries = self._index.get(piece.name, [])
            if not entries or any(kind not in self._flats[(r, g)] for r, g, _, _ in entries):
                continue
            out = []
            for rank, g, start, end in entries:
                for _, lo, hi, at in overlaps(piece, [(0, start, end)]):
                    flat = self._flats[(rank, g)][kind]
                    base = self._offsets[(rank, g, piece.name)]
                    out.append((flat, base + lo, base + hi, at))
            return out
        return []

    def buffer_into(self, name: str, dst: torch.Tensor) -> None:
        dst.view(-1).copy_(self._models[0]["module"][name].reshape(-1))

    def read_buffer(self, name: str) -> torch.Tensor:
        return self._models[0]["module"][name].clone()

    def read_state(self, trusted: bool = False) -> dict[str, Any]:
        """The engine state in zengine's form: per optimizer group the hyper-parameters, the state keys and
        the scalar states (Adam's ``step``); the LR scheduler; the loss scale; the client_state. Checks first
        that DeepSpeed's groups hold the engine's (after native/load.py compared the parameter names)."""
        self._check_groups(self._engine_groups)
        base = self._optim[0][self.layout.optimizer_key]
        groups = []
        for group in base["param_groups"]:
            first = base["state"].get(group["params"][0], {}) if group["params"] else {}
            groups.append(
                {
                    "hyper": {k: group[k] for k in _HYPER if k in group},
                    "keys": list(first),
                    "scalars": {
                        k: v for k, v in first.items() if not (torch.is_tensor(v) and v.dim() > 0)
                    },
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


def _loss_scaler(saved: Optional[Any]) -> dict[str, Any]:
    """DeepSpeed's loss scaler as zengine's state (precision/loss_scaler.py); {} when there is none."""
    if saved is None or not hasattr(saved, "get"):
        return {}
    state = {"scale": saved.get("cur_scale")}
    if saved.get("dynamic"):
        state.update(
            hysteresis_left=saved.get("cur_hysteresis"),
            iteration=saved.get("cur_iter"),
            last_overflow_iteration=saved.get("last_overflow_iter"),
        )
    return {k: v for k, v in state.items() if v is not None}
