"""One stage-3 parameter: its shard, its full storage, and whether it is gathered.

Each parameter is split into ``world`` equal chunks of its flattened
elements (the last padded); rank r keeps chunk r. When gathered, the
parameter's ``.data`` is a view into a full buffer ``[world * chunk]``. On
release the storage is freed (resized to 0) and the parameter shows an
empty tensor; the next fetch re-allocates it and points the parameter back,
before any backward that saved the parameter runs.
Writes into the full buffer go through the buffer, never through the
parameter, so they do not bump the parameter's version counter.

Which parameters are sharded is kept in a table of ours (``registry``), not
in attributes on ``nn.Parameter``.
"""

from __future__ import annotations

import enum
import itertools
import math
import weakref
from typing import Optional

import torch
from torch import nn

from ...offload import pinned


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only this rank's chunk exists; the full storage is freed
    GATHERED = "gathered"  # the full parameter is in memory


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names and values for ``param.ds_status``."""

    AVAILABLE = 1  # gathered
    NOT_AVAILABLE = 2  # only the shard exists
    INFLIGHT = 3  # being gathered


class ZeroParameter(nn.Parameter):
    """A stage-3 parameter as DeepSpeed scripts read it: ``ds_shape``, ``ds_numel``, ``ds_status``,
    ``ds_id``, ``ds_tensor`` (the shard), ``ds_persist``. Each is looked up in ``registry``, nothing is
    stored on the parameter; on a parameter that is not (or no longer) sharded each raises
    AttributeError, so ``hasattr(p, "ds_id")``, DeepSpeed's test for a ZeRO-3 parameter, is False."""

    def _sharded(self) -> "ShardedParam":
        sp = lookup(self)
        if sp is None:
            raise AttributeError("not a stage-3 sharded parameter")
        return sp

    @property
    def ds_shape(self) -> torch.Size:
        """The full shape (the parameter itself may show an empty tensor)."""
        return torch.Size(self._sharded().shape)

    @property
    def ds_numel(self) -> int:
        """Elements of the full parameter."""
        return self._sharded().numel

    @property
    def ds_status(self) -> ZeroParamStatus:
        """AVAILABLE when gathered, else NOT_AVAILABLE."""
        gathered = self._sharded().state is ParamState.GATHERED
        return ZeroParamStatus.AVAILABLE if gathered else ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_id(self) -> int:
        """A number per sharded parameter, in creation order."""
        return self._sharded().index

    @property
    def ds_tensor(self) -> Optional[torch.Tensor]:
        """This rank's shard ([chunk]: the compute dtype, or the masters' where the shard is the
        master, the optimizer being on the device)."""
        return self._sharded().shard

    @property
    def ds_active_sub_modules(self) -> "ActiveSubModules":
        """The forward holds on it (DeepSpeed: the modules using it now); ``clear()`` drops them,
        so the next release frees it (TRL clears them before taking the hooks off)."""
        return ActiveSubModules(self._sharded())

    @property
    def ds_persist(self) -> bool:
        """Whether it stays gathered (below stage3_param_persistence_threshold)."""
        return self._sharded().persistent


class ActiveSubModules:
    """A stage-3 parameter's forward holds, shown as DeepSpeed's set of the modules using it: zengine
    counts holds rather than naming modules, so this is sized and cleared, not listed."""

    def __init__(self, sp: "ShardedParam"):
        self._sp = sp

    def __len__(self) -> int:
        return self._sp.holders

    def __bool__(self) -> bool:
        return self._sp.holders > 0

    def clear(self) -> None:
        """Drop every forward hold (the parameter is freed at its next release, unless pinned)."""
        self._sp.holders = 0


_next_index = itertools.count()  # ds_id: a number per sharded parameter, in creation order


class ShardedParam:
    """A parameter sharded across the data-parallel ranks."""

    def __init__(self, name: str, param: nn.Parameter, world: int, rank: int):
        self.name = name
        self._param = weakref.ref(param)
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.world, self.rank = world, rank
        self.chunk = max(1, math.ceil(self.numel / world))
        self.valid = max(
            0, min(self.chunk, self.numel - rank * self.chunk)
        )  # real elements in my chunk
        self.shard: Optional[torch.Tensor] = (
            None  # [chunk], a view into its group's shard buffer (in the group's dtype: group.py)
        )
        # NVMe offload (offload/param_swap.py): the swap that holds the shard, and its first element there; ``shard`` is
        # then None, or a resident copy (max_in_cpu)
        self.swap_file = None
        self.file_elem = 0
        self.full = torch.empty(
            world * self.chunk, dtype=param.dtype, device=param.device
        )  # [world*chunk]
        self.state = ParamState.GATHERED
        self.holders = 0  # forward-time fetches not yet released
        self.persistent = (
            False  # small parameters stay gathered (stage3_param_persistence_threshold)
        )
        self.pinned = False  # held gathered by summon_full_params / GatheredParameters
        self.owner = (
            None  # the Stage3Optimizer holding it, once in an engine (GatheredParameters asks it)
        )
        self.freed_version = (
            None  # the parameter's version counter when last released (see written_while_released)
        )
        # a script's write the engine would lose, noted when the engine swaps the storage
        self.lost_write: Optional[str] = None
        self.index = next(_next_index)
        if (
            type(param) is nn.Parameter
        ):  # so that scripts can read DeepSpeed's ds_* members (ZeroParameter)
            param.__class__ = ZeroParameter
        with torch.no_grad():
            self.full.narrow(0, 0, self.numel).copy_(param.detach().reshape(-1))
            self.full.narrow(0, self.numel, self.full.numel() - self.numel).zero_()
        self._empty = torch.empty(
            0, dtype=param.dtype, device=param.device
        )  # what a released parameter shows
        param.data = self._view()

    def _view(self) -> torch.Tensor:
        return self.full.narrow(0, 0, self.numel).view(self.shape)

    @property
    def param(self) -> nn.Parameter:
        return self._param()

    @property
    def full_nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def attach_shard(self, shard: torch.Tensor) -> None:
        """Point at this rank's chunk inside a group buffer and fill it (from the full data, or from the
        chunk it held before when it was already sharded, e.g. by zero.Init)."""
        with torch.no_grad():
            shard.copy_(self.current_shard())
        self._leave_swap()
        self.shard = shard

    def current_shard(self) -> torch.Tensor:
        """This rank's chunk as it stands now: from the full data when gathered, else the shard (read from
        its swap when it lives on NVMe)."""
        if self.state is ParamState.GATHERED:
            return self.full.narrow(0, self.rank * self.chunk, self.chunk)
        if self.shard is not None:
            return self.shard
        return self.swap_file.take_copy(self)

    def move_to_swap(self, swap_file, elem: int, resident: bool) -> None:
        """Make ``swap_file`` (an NVMe swap) the home of this rank's chunk, at element ``elem``; with
        ``resident`` a copy stays in host memory too."""
        with torch.no_grad():
            value = self.current_shard()
            if (
                resident
            ):  # a cache of the file in host memory, as it holds it (pinned where the swap pins)
                value = pinned.empty(
                    self.chunk, swap_file.dtype, kind=pinned.PARAMETERS, pin=swap_file.pin
                ).copy_(value)
            self._leave_swap()
            self.swap_file, self.file_elem = swap_file, elem
            self.shard = value if resident else None
            swap_file.write_shard(self, value)

    def _leave_swap(self) -> None:
        if self.swap_file is not None:
            self.swap_file.forget(self)
        self.swap_file = None

    def retype(self, dtype: torch.dtype, device: torch.device) -> None:
        """Gather into ``dtype`` on ``device`` from now on (a sharded parameter adopted by an engine)."""
        if self.full.dtype == dtype and self.full.device == device:
            return
        assert self.state is ParamState.SHARDED, "retype a gathered parameter"
        self.full = torch.empty(self.world * self.chunk, dtype=dtype, device=device)
        self.full.untyped_storage().resize_(0)
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.param.data = self._empty

    def allocate(self) -> torch.Tensor:
        """Re-allocate the full storage (contents undefined) and return the [world, chunk] view to fill."""
        storage = self.full.untyped_storage()
        if storage.nbytes() != self.full_nbytes:
            self._note_user_writes()
            storage.resize_(self.full_nbytes)
            self.param.data = self._view()
        return self.full.view(self.world, self.chunk)

    def free(self) -> None:
        """Drop the full storage; the parameter shows an empty tensor (as under DeepSpeed) until fetched."""
        self._note_user_writes()
        self.param.data = self._empty
        self.full.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED
        self.holders = 0
        self.freed_version = self.param._version

    def _note_user_writes(self) -> None:
        """Before the engine swaps the parameter's storage: note a script's write it would lose
        (``lost_write``, raised at the next step by zero/param_writes.py)."""
        param = self.param
        if param is None or self.lost_write is not None:
            return
        mine = {self._empty.untyped_storage()._cdata, self.full.untyped_storage()._cdata}
        if param.untyped_storage()._cdata not in mine:
            self.lost_write = ".data was replaced by another tensor outside a gather"
        elif self.written_while_released:
            self.lost_write = "written in place while partitioned (it shows an empty tensor)"

    def user_write(self) -> Optional[str]:
        """Why a script's write to this parameter is lost (``lost_write``), or None."""
        self._note_user_writes()
        return self.lost_write

    @property
    def written_while_released(self) -> bool:
        """True when something wrote the parameter in place while it showed its empty tensor (an init function
        run on a partitioned parameter): the write went nowhere. Read from the parameter's version counter,
        which every in-place write bumps, even of no element."""
        param = self.param  # (None once the module that held it is gone)
        return (
            self.state is ParamState.SHARDED
            and self.freed_version is not None
            and param is not None
            and param._version != self.freed_version
        )

    def write_back_full(self) -> None:
        """Copy this rank's chunk of the (modified) full data into the shard."""
        with torch.no_grad():
            mine = self.full.narrow(0, self.rank * self.chunk, self.chunk)
            if self.swap_file is not None:
                self.swap_file.write_shard(self, mine)  # updates the resident copy too
            else:
                self.shard.copy_(mine)


# Sharded parameters by id(parameter): consulted by the hooks and zero.GatheredParameters. An entry
# goes away with its parameter (ShardedParam holds the parameter weakly).
registry: dict[int, ShardedParam] = {}


def register(sp: ShardedParam) -> None:
    registry[id(sp.param)] = sp
    weakref.finalize(sp.param, registry.pop, id(sp.param), None)


def lookup(t) -> Optional[ShardedParam]:
    """The ShardedParam of a parameter, or None."""
    sp = registry.get(id(t))
    return sp if sp is not None and sp.param is t else None
