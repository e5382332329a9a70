"""``deepspeed.checkpoint.utils`` as libraries import it (Hugging Face's Trainer saves state dicts
through ``clone_tensors_for_torch_save``)."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """A copy of ``item`` (a tensor, or lists, tuples and dicts of them, nested) whose tensors are
    detached clones on ``device``, each owning exactly its own elements, so that ``torch.save`` writes
    no more than the tensors hold (a view of a flat buffer would save the whole buffer)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
