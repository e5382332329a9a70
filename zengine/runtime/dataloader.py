"""``RepeatingLoader``: iterate a data loader forever (DeepSpeed's ``deepspeed.utils.RepeatingLoader``)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator


class RepeatingLoader:
    """Wraps an iterable (a ``DataLoader``) so that ``next()`` never raises ``StopIteration``: at the
    end it starts a new pass. A ``DistributedSampler`` in the loader gets ``set_epoch`` with the next
    epoch at each new pass (starting from the epoch the script set, e.g. on resume), so every pass is
    shuffled differently and the same way on every rank."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.epoch = int(getattr(getattr(loader, "sampler", None), "epoch", 0))
        self.data_iter = iter(self.loader)

    def _set_epoch(self) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            self._set_epoch()
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
