"""``zengine.comm``: the communication functions DeepSpeed scripts call as ``deepspeed.comm``.

    import zengine.comm as dist          # in DeepSpeed scripts: import deepspeed.comm as dist
    if dist.get_rank() == 0: ...
    dist.all_reduce(t, op=dist.ReduceOp.SUM)

Each function has DeepSpeed's name, parameters and meaning and calls the
torch.distributed function of the same name on the default group (or the
group given). DeepSpeed's extra keywords for its communication logger
(``prof``, ``log_name``, ``debug``) are accepted and have no effect here.
Before the process group exists, ``get_rank`` is 0 and ``get_world_size`` 1,
so that a script also runs as a single process without a launcher.

The engine's own collectives (bucketed, checked against the backend's
devices, diagnosed when a rank is missing) live in ``zengine.distributed.collectives``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as _dist

from .distributed.process_group import init_distributed as _init_distributed
from .distributed.process_group import local_rank as _local_rank

ReduceOp = (
    _dist.ReduceOp
)  # DeepSpeed's enum mirrors torch's members (SUM, AVG, MAX, ...): use torch's directly

init_distributed = _init_distributed  # DeepSpeed's signature (zengine.distributed.init_distributed)


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return _dist.is_available() and _dist.is_initialized()


def is_available() -> bool:
    """Whether torch was built with distributed support."""
    return _dist.is_available()


def destroy_process_group(group=None) -> None:
    """Destroy ``group`` (default: the default group and every other)."""
    _dist.destroy_process_group(group)


def new_group(ranks: list[int]):
    """A new process group of ``ranks`` (every rank must call it)."""
    return _dist.new_group(ranks)


def get_rank(group=None) -> int:
    """This process's rank in ``group``; 0 before the process group exists."""
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """The number of ranks in ``group``; 1 before the process group exists."""
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK``, else OpenMPI's, MVAPICH's, MPICH's or SLURM's
    variable (``zengine.distributed.process_group.local_rank``, the rule every part uses)."""
    return _local_rank()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group():
    """The default process group."""
    return _dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    """The global ranks of the members of ``group``."""
    return (
        _dist.get_process_group_ranks(group) if group is not None else list(range(get_world_size()))
    )


def get_backend(group=None) -> str:
    """The backend name of ``group`` (``nccl``, ``gloo`` ...)."""
    return _dist.get_backend(group)


# -- collectives: torch's, with DeepSpeed's logging keywords accepted --------------------------------
def barrier(
    group=None,
    async_op: bool = False,
    device_ids=None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: Any = None,
):
    """Wait until every rank of ``group`` gets here."""
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(
    group=None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False
):
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo)."""
    return _dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: Any = None,
):
    """Reduce ``tensor`` over the ranks in place (sum by default)."""
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: Any = None,
):
    """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank)."""
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug: Any = None,
):
    """Every rank's ``tensor`` concatenated into ``output_tensor`` (world x its size)."""
    return _dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


allgather_fn = all_gather_into_tensor  # DeepSpeed's older name


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: Any = None,
):
    """Reduce ``tensor`` over the ranks; rank r keeps its r-th equal part in ``output_tensor``."""
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter",
    debug: Any = None,
):
    """Reduce ``input_list`` over the ranks; rank r keeps the reduced ``input_list[r]`` in ``output``."""
    return _dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: Any = None,
):
    """Rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group=None, device=None):
    """Rank ``src``'s picklable objects into every rank's ``object_list``."""
    return _dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather_object(object_list: list, obj: Any, group=None):
    """Every rank's picklable ``obj`` into ``object_list``."""
    return _dist.all_gather_object(object_list, obj, group=group)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: Any = None,
):
    """Reduce ``tensor`` over the ranks into rank ``dst``'s ``tensor``."""
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: Optional[list] = None,
    dst: int = 0,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: Any = None,
):
    """Every rank's ``tensor`` into rank ``dst``'s ``gather_list``."""
    return _dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: Optional[list] = None,
    src: int = 0,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: Any = None,
):
    """Rank ``src``'s ``scatter_list[r]`` into rank r's ``tensor``."""
    return _dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: Any = None,
):
    """Split ``tensor`` across the ranks and gather what each rank sends into ``output``."""
    return _dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )


def send(
    tensor: torch.Tensor,
    dst: int,
    group=None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: Any = None,
):
    """Send ``tensor`` to rank ``dst`` (blocking)."""
    return _dist.send(tensor, dst, group=group, tag=tag)


def recv(
    tensor: torch.Tensor,
    src: Optional[int] = None,
    group=None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: Any = None,
):
    """Receive into ``tensor`` from rank ``src`` (any rank when None; blocking)."""
    return _dist.recv(tensor, src, group=group, tag=tag)


def isend(
    tensor: torch.Tensor,
    dst: int,
    group=None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: Any = None,
):
    """Send ``tensor`` to rank ``dst``; returns a work handle."""
    return _dist.isend(tensor, dst, group=group, tag=tag)


def irecv(
    tensor: torch.Tensor,
    src: Optional[int] = None,
    group=None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: Any = None,
):
    """Receive into ``tensor`` from rank ``src``; returns a work handle."""
    return _dist.irecv(tensor, src, group=group, tag=tag)


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed prints its communication logger's table here; zengine keeps no such log (accepted, no-op)."""


def configure(
    deepspeed_config: Any = None,
    enabled: Optional[bool] = None,
    prof_all: Optional[bool] = None,
    prof_ops: Any = None,
    verbose: Optional[bool] = None,
    debug: Optional[bool] = None,
) -> None:
    """DeepSpeed's communication-logger settings: accepted; zengine has no communication logger."""
