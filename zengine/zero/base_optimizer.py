"""``deepspeed.runtime.base_optimizer``: the base classes of DeepSpeed's optimizer wrappers, which
libraries test optimizers against (Lightning Fabric's ``load`` restores the optimizer state only
when one of the objects it is given ``isinstance(..., (Optimizer, DeepSpeedOptimizer))``).

zengine's ZeRO optimizer (``zero/optimizer.py``, every stage) derives from ``ZeROOptimizer``, which
also gives it DeepSpeed's ``state_dict`` (this rank's shard, for inspection: Lightning's Trainer
asks for it when it saves, then keeps DeepSpeed's own checkpoint instead) and a ``load_state_dict``
that says where the state is restored from (``engine.load_checkpoint``).
"""

from __future__ import annotations

from typing import Any

import torch


class DeepSpeedOptimizer:
    """DeepSpeed's root class of the optimizers ``initialize`` returns: a wrapper around a torch
    optimizer (``self.optimizer``) that shows torch's ``param_groups``, ``state`` and ``defaults``
    as the wrapped one's, so that schedulers and scripts read and write them there."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's class of its ZeRO optimizers. A subclass provides ``optimizer`` (the wrapped
    torch optimizer over this rank's flat fp32 master shards), ``masters`` (those shards),
    ``world`` (the ranks they are cut over), ``abilities`` and ``master_store`` (whether states
    stay in memory) and ``states_resident()`` (a context with every state in memory)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer: the wrapped optimizer's ``state_dict`` over its flat
        master shards (``base_optimizer_state``), the shards themselves
        (``single_partition_of_fp32_groups``, DeepSpeed's name) and ``partition_count``. One
        rank's view, as DeepSpeed's; a checkpoint is ``engine.save_checkpoint``. Its tensors are
        the optimizer's own, as torch's and DeepSpeed's are (no copy of the shard at every
        Lightning save), except where states are swapped out between steps (NVMe offload): then
        copies, read in for the call."""
        with self.states_resident():
            base = self.optimizer.state_dict()
            masters = list(self.masters)
            if self._swaps_states():
                base["state"] = {
                    key: {name: _copy(value) for name, value in per_param.items()}
                    for key, per_param in base["state"].items()
                }
                masters = [m.detach().clone() for m in masters]
            return {
                "base_optimizer_state": base,
                "single_partition_of_fp32_groups": masters,
                "partition_count": self.world,
            }

    def _swaps_states(self) -> bool:
        """Whether states leave memory outside ``states_resident()``: the optimizer or the master
        store has its own residency (NVMe offload swaps moments and masters to files)."""
        from ..ops.shard_optimizer import ShardOptimizer
        from ..offload.masters import MastersInMemory

        return (
            type(self.abilities).states_in_memory is not ShardOptimizer.states_in_memory
            or type(self.master_store).resident is not MastersInMemory.resident
        )

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """Refused: a ZeRO optimizer's state is sharded over the ranks and restored with the model's
        (``engine.load_checkpoint(load_dir, load_optimizer_states=True)``, which also takes any
        world size and stage); one rank's ``state_dict`` cannot restore it."""
        raise NotImplementedError(
            "ZeRO optimizer load_state_dict: the optimizer state is sharded over the ranks and "
            "restored with engine.load_checkpoint(load_dir) (load_optimizer_states=True), not from "
            "a state_dict"
        )


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
