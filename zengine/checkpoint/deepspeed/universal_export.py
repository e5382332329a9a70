"""The way back as a universal checkpoint: ``zengine-convert to-universal`` writes a zengine checkpoint in
the layout of DeepSpeed's ``ds_to_universal`` (universal.py), which DeepSpeed loads at any world size with
``checkpoint.load_universal: true``, and zengine too.

    <save_dir>/latest_universal                  the folder's name
    <save_dir>/<tag>_universal/
        zero/<param>/fp32.pt, exp_avg.pt,         {"param": the whole tensor, shaped}, per trained
        exp_avg_sq.pt, step.pt                    parameter (step: its group's count, as DeepSpeed
                                                  steps a group at once)
        zero/optimizer_state.pt                   the ZeRO stage, partition count, loss scaler, clip,
                                                  param_groups (top level: stages 1-2; and in
                                                  optimizer_state_dict with the step: stage 3)
        *_model_states.pt                         the module, tied names, frozen parameters, LR
                                                  scheduler, counters, client_state: export.py's files
                                                  for one rank of the target config's stage

DeepSpeed reads the model-states file of its own stage, so the target config (its ZeRO stage, 16-bit
dtype) is given, as for ``to-deepspeed``; the world size is not.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Optional

import torch

from ..native.holdings import Holding
from ..native.pieces import Piece
from ..native.reader import CheckpointReader, checkpoint_directory
from .export import export_deepspeed_checkpoint
from .files import load_ds_file, save_ds_file
from .layout import layout_for
from .universal import LATEST_UNIVERSAL, MASTER_FILE, OPTIMIZER_STATE, ZERO

# what the optimizer file of a ZeRO checkpoint holds that a universal one does not: the flat tensors
_FLAT_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups", "param_slice_mappings")


def export_universal_checkpoint(
    checkpoint_dir: str,
    save_dir: str,
    ds_config: dict,
    tag: Optional[str] = None,
    out_tag: Optional[str] = None,
    trusted: bool = False,
) -> str:
    """Write the zengine checkpoint ``checkpoint_dir`` (``tag`` default: ``latest``) as DeepSpeed's universal
    checkpoint ``save_dir/<out_tag>`` (default ``global_step<N>_universal``) for ``ds_config``; returns it."""
    directory = checkpoint_directory(checkpoint_dir, tag)
    scratch = os.path.join(save_dir, ".tmp-universal")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        zero_dir = export_deepspeed_checkpoint(directory, scratch, 1, ds_config, trusted=trusted)
        with CheckpointReader(directory) as reader:
            state = reader.read_state(trusted)
            out_tag = out_tag or f"global_step{reader.meta['global_steps']}_universal"
            final = os.path.join(save_dir, out_tag)
            shutil.rmtree(final, ignore_errors=True)
            os.makedirs(os.path.join(final, ZERO))
            steps = _write_params(reader, state, os.path.join(final, ZERO))
        _write_common(zero_dir, final, steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(save_dir, LATEST_UNIVERSAL), "w") as f:
        f.write(out_tag)
    return final


def _write_params(reader: CheckpointReader, state: dict, zero: str) -> list[int]:
    """zero/<param>/*.pt of every trained parameter; returns each group's step count."""
    steps = []
    for group in state["optimizer"]:
        counts = group.get("step_counts") or {}
        step = max(counts.values(), default=0)
        steps.append(step)
        per_element = [k for k in group["keys"] if k not in group["scalars"]]
        for name in counts:
            shape = reader.meta["params"][name]["shape"]
            folder = os.path.join(zero, name)
            os.makedirs(folder)
            for key, kinds in [(MASTER_FILE, ("master", "param"))] + [
                (k, (f"state.{k}",)) for k in per_element
            ]:
                whole = torch.zeros(math.prod(shape), dtype=torch.float32)
                piece = Piece(name, 0, whole.numel(), 0)
                reader.fill(Holding(whole, [piece]), kinds, required=key == MASTER_FILE)
                torch.save({"param": whole.view(shape)}, os.path.join(folder, f"{key}.pt"))
            torch.save(torch.tensor(float(step)), os.path.join(folder, "step.pt"))
    return steps


def _write_common(zero_dir: str, final: str, steps: list[int]) -> None:
    """The model-states files as export.py wrote them for one rank, and optimizer_state.pt from its
    optimizer file less the flat tensors."""
    names = os.listdir(zero_dir)
    for name in names:
        if name.endswith("_model_states.pt"):
            shutil.copy(os.path.join(zero_dir, name), os.path.join(final, name))
    optim = next(n for n in names if n.endswith("_optim_states.pt"))
    sd = load_ds_file(os.path.join(zero_dir, optim), trusted=True)["optimizer_state_dict"]
    stage = int(sd["zero_stage"]) if "zero_stage" in sd else 1  # none: the bf16 optimizer, stage 1
    layout = layout_for(stage, "zero_stage" not in sd, 1)
    wrapped = sd.pop(layout.optimizer_key)
    common = {k: v for k, v in sd.items() if k not in _FLAT_KEYS}
    common["param_groups"] = wrapped["param_groups"]
    if stage == 3:  # DeepSpeed's stage 3 reads the step and hyper-parameters from here
        common[layout.optimizer_key] = {
            "state": {0: {"step": torch.tensor(float(max(steps, default=0)))}},
            "param_groups": wrapped["param_groups"],
        }
    save_ds_file(common, os.path.join(final, ZERO, OPTIMIZER_STATE))
