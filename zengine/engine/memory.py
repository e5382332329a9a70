"""``engine.memory_breakdown()``: the bytes a rank holds, by kind, counted from the tensors themselves."""

from __future__ import annotations

from torch import nn

from ..offload import pinned

PINNED_HOST = "pinned_host"  # memory_breakdown()'s entry that is a place, not a kind
HOST_STATES = "host_states"  # another place: optimizer-side states in host memory (offload)
WORKSPACE = "workspace"  # memory_breakdown()'s entry for storage kept for reuse: not model state
SHARED_SEGMENT = (
    "shared_segment"  # the collectives' shared-memory segment (distributed/shm.py): one per host
)
SWAP_FILES = "swap_files"  # bytes on disk (NVMe offload's swap files): a place, not memory
KINDS = ("parameters", "gradients", "master_weights", "optimizer_states", "buffers")
OPTIMIZER_SIDE = ("gradients", "master_weights", "optimizer_states")  # what offload_optimizer moves


def memory_breakdown(module: nn.Module, optimizer, transport=None) -> dict[str, int]:
    """Bytes held by kind: ``parameters`` covers the flat compute-dtype buffers and any parameter outside them
    (frozen ones); ``gradients`` the gradient buffers or shards; ``master_weights`` fp32 masters stored apart
    from the parameters; ``optimizer_states`` the wrapped optimizer's tensors; ``buffers`` the module's. Each
    storage counts once.

    ``pinned_host`` is not a kind but where some of them are: the page-locked host bytes zengine holds in this
    process (offloaded shards, copy staging, swap buffers, an asynchronous checkpoint's snapshot;
    ``offload/pinned.py``, by kind in ``zengine.offload.pinned.held()``), each pinned at its exact size. It
    overlaps the kinds: leave it out of a sum (``model_state_bytes``).

    ``host_states`` is another place: the bytes of ``gradients``, ``master_weights`` and
    ``optimizer_states`` in host memory while the compute device is another (``offload_optimizer``;
    with ``ratio`` below 1 the host share of the sub-groups, the rest being on the device). 0 on a
    CPU run. It overlaps the kinds too.

    ``workspace`` is memory held for reuse that holds no model state (on the host: released gradient bucket
    buffers, kept for the next backward because the host's allocator would hand them back to the system and
    fault every page in again; a device's caching allocator keeps such blocks itself, uncounted). It adds to the
    kinds; ``model_state_bytes`` leaves it out.

    ``shared_segment`` is the bytes of the shared-memory segment the collectives go through (``transport``,
    ``distributed/shm.py``), mapped by every rank on the host: one segment a host, not a rank. Not model
    state: ``model_state_bytes`` leaves it out.

    ``swap_files`` is the bytes of this rank's swap files on disk (``offload_optimizer`` and
    ``offload_param`` on NVMe): the records of the swapped states (fp32: 8 bytes per element of the
    shard for the moments, 16 for ZeRO-Infinity's ``[exp_avg | exp_avg_sq | master | grad]``; bf16
    masters and states: 4 and 8, Kahan 10) and the parameter shards, padded to 4096-byte blocks. Not
    memory: ``model_state_bytes`` leaves it out."""
    kinds = optimizer.memory_tensors()
    kinds["parameters"] = kinds["parameters"] + list(module.parameters())
    kinds["buffers"] = list(module.buffers())
    seen: set[int] = set()
    out = {}
    for kind in KINDS:
        total = 0
        for t in kinds[kind]:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[kind] = total
    out[WORKSPACE] = sum(
        t.untyped_storage().nbytes()
        for t in kinds.get(WORKSPACE, ())
        if t.untyped_storage().data_ptr() not in seen
    )
    out[HOST_STATES] = _host_bytes(kinds, optimizer)
    out[PINNED_HOST] = pinned.held_bytes()
    out[SHARED_SEGMENT] = transport.segment.numel() if transport is not None else 0
    out[SWAP_FILES] = _swap_bytes(optimizer)
    return out


def _swap_bytes(optimizer) -> int:
    """Bytes of the optimizer's swap file and the parameters' (``offload_param.device: nvme``)."""
    params = optimizer.placement.params.swap
    return optimizer.abilities.swap_bytes() + (params.file.size if params is not None else 0)


def _host_bytes(kinds: dict, optimizer) -> int:
    """Bytes of the optimizer-side kinds stored in host memory, when the compute device is not the host."""
    device = getattr(optimizer, "device", None)
    if device is None or device.type == "cpu":
        return 0
    seen: set[int] = set()
    total = 0
    for kind in OPTIMIZER_SIDE:
        for t in kinds[kind]:
            storage = t.untyped_storage()
            if t.device.type != "cpu" or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(breakdown: dict[str, int]) -> int:
    """The model-state bytes of a ``memory_breakdown()``: its kinds summed, ``pinned_host`` and
    ``host_states`` (overlays) and ``workspace`` and ``shared_segment`` (not model state) left out."""
    overlays = (PINNED_HOST, HOST_STATES, WORKSPACE, SHARED_SEGMENT, SWAP_FILES)
    return sum(v for k, v in breakdown.items() if k not in overlays)
