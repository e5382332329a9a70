"""``engine.save_16bit_model``: the full model in the compute dtype, streamed module by module to rank 0's file.

Modules are visited in ``state_dict`` order. At stage 3 each module's own
parameters are gathered while its tensors are written, then released, so no
rank ever holds more than one module whole; at stages 0-2 parameters are
whole already. Rank 0 streams each tensor into the file as it comes (a torch
file, or safetensors when the name ends in ``.safetensors``); a tensor that
is not whole (an empty stage-3 placeholder) is an error, never written. The
file appears under its name only once complete.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets

import torch

from ..native import collectives, meta as meta_mod
from ..errors import CheckpointSaveError
from ..native.tensorfile import TensorFileWriter, TensorSpec
from ..native.torchfile import TorchFileWriter
from ...zero.stage3.param import lookup


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    """Collective: rank 0 writes ``save_dir/save_filename``; returns True (raises on failure, on every rank)."""
    opt = engine.optimizer
    model = meta_mod.describe_model(engine.module, set())
    shapes = {id(p): model["params"][n]["shape"] for n, p in engine.module.named_parameters()}
    path = os.path.join(save_dir, save_filename)
    sink = _Sink(path, model) if engine.global_rank == 0 else None
    tied = not save_filename.endswith(
        ".safetensors"
    )  # safetensors has no shared tensors: write copies
    first: dict[int, str] = {}
    for prefix, module in engine.module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        params = [(pre + n, p) for n, p in module._parameters.items() if p is not None]
        with _whole(opt, [p for _, p in params if not (tied and id(p) in first)]):
            for key, p in params:
                if sink is not None:
                    if tied and id(p) in first:
                        sink.alias(key, first[id(p)])
                    else:
                        sink.write(key, p.detach(), shapes[id(p)])
                first.setdefault(id(p), key)
        for n, b in module._buffers.items():
            if sink is not None and b is not None and n not in module._non_persistent_buffers_set:
                sink.write(pre + n, b.detach(), list(b.shape))
    error = sink.finish() if sink is not None else None
    error = collectives.broadcast(error, opt.dp_group)
    if error:
        raise CheckpointSaveError(f"save_16bit_model: could not write {path}: {error}")
    return True


class _Sink:
    """Rank 0's output: a temporary file renamed into place when complete; keeps the first error and
    writes nothing after it (the other ranks still need rank 0 in the gathers)."""

    def __init__(self, path: str, model: dict):
        self.path = path
        self.tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        self.error = None
        self.writer = None
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.writer = _open(self.tmp, path.endswith(".safetensors"), model)
        except OSError as e:
            self.error = str(e)

    def write(self, key: str, tensor: torch.Tensor, shape) -> None:
        if tensor.numel() != math.prod(shape):
            self._fail(
                f"{key} has {tensor.numel()} elements, expected {math.prod(shape)} (shape {tuple(shape)}): "
                f"it was not gathered"
            )
        self._do(self.writer.write if self.writer else None, key, tensor.reshape(shape))

    def alias(self, key: str, other: str) -> None:
        self._do(self.writer.alias if self.writer else None, key, other)

    def _do(self, fn, *args) -> None:
        if self.error or fn is None:
            return
        try:
            fn(*args)
        except OSError as e:
            self._fail(str(e))

    def _fail(self, message: str) -> None:
        if not self.error:
            self.error = message
            if self.writer is not None:
                self.writer.abort()

    def finish(self):
        """Close and rename into place; the error (None when all went well). The temporary file never stays."""
        try:
            if not self.error:
                self.writer.close()
                os.replace(self.tmp, self.path)
        except OSError as e:
            self.error = str(e)
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
        return self.error


def _open(path: str, safetensors: bool, model: dict):
    if not safetensors:
        return TorchFileWriter(path)
    specs = []
    for key, kind, source in model["state_dict"]:
        entry = model["params" if kind == "param" else "buffers"][source]
        specs.append(TensorSpec(key, meta_mod.dtype_of(entry["dtype"]), tuple(entry["shape"])))
    return TensorFileWriter(path, specs, plain_metadata={"format": "pt"})


def _whole(opt, params):
    """Stage 3: gather ``params`` for the block; other stages hold them whole already."""
    sharded = list({id(sp): sp for sp in (lookup(p) for p in params) if sp is not None}.values())
    if not sharded or not hasattr(opt, "full_params"):
        return contextlib.nullcontext()
    return opt.full_params(sharded)


def consolidated_state_dict(engine, exclude_frozen_parameters: bool = False):
    """Collective: the full model's state_dict in the compute dtype, on rank 0's host (None on the other
    ranks), gathered module by module as ``save_16bit_model`` does. A parameter reached under several names
    (tied weights) is one tensor under all of them; ``exclude_frozen_parameters`` leaves out the
    parameters that do not require a gradient. DeepSpeed's ``_zero3_consolidated_16bit_state_dict``."""
    opt = engine.optimizer
    model = meta_mod.describe_model(engine.module, set())
    shapes = {id(p): model["params"][n]["shape"] for n, p in engine.module.named_parameters()}
    out = {} if engine.global_rank == 0 else None
    first: dict[int, torch.Tensor] = {}
    for prefix, module in engine.module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        params = [
            (pre + n, p)
            for n, p in module._parameters.items()
            if p is not None and not (exclude_frozen_parameters and not p.requires_grad)
        ]
        with _whole(opt, [p for _, p in params if id(p) not in first]):
            for key, p in params:
                if id(p) not in first:
                    first[id(p)] = (
                        p.detach().reshape(shapes[id(p)]).clone().cpu() if out is not None else p
                    )
                if out is not None:
                    out[key] = first[id(p)]
        for n, b in module._buffers.items():
            if out is not None and b is not None and n not in module._non_persistent_buffers_set:
                out[pre + n] = b.detach().clone().cpu()
    return out
