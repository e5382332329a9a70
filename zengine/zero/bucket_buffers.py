"""The storage of gradient bucket buffers, kept for reuse (stages 2 and 3).

A fresh large allocation for every bucket costs page faults on first touch, so a reduced bucket's
storage goes back to a pool and the next bucket is carved from it. At most ``in_flight + 1`` of them
exist at a time, so still no whole gradient. A bucket buffer is not zeroed: every gradient is copied
into its place, and only what no gradient wrote is zeroed when the bucket launches (``reducer.py``).

With offload on a device with side streams, a released buffer may still be read by the download of
its reduced piece (``offload/copies.py``): each is kept with the copies' mark after that read, and
the compute stream waits for the mark, on the device, before the storage is rewritten (the only
point where it waits for a download). Up to ``DOWNLOAD_BACKLOG_BYTES`` of them more may exist while
their downloads run.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..device import reuses_freed_blocks
from ..offload.copies import HostCopies

Key = tuple[int, int]  # (group, bucket index)


class BucketBuffers:
    """The buffers of the buckets being filled or reduced (``live``), and released storage to carve
    new ones from, in ``dtype`` (the reduce dtype); ``copies`` marks and awaits the downloads'
    reads."""

    # Bytes of released bucket buffers whose download may still be reading them that backward may
    # hold before it reuses one (the compute stream then waits for that read, on the device). Below
    # it, backward never waits for the copies to the host: 1 GiB is 10 buckets of the bench_gpu 1.3B
    # model (50M elements, bf16), the downloads it may trail by without slowing backward.
    DOWNLOAD_BACKLOG_BYTES = 1 << 30

    def __init__(self, dtype: torch.dtype, copies: HostCopies):
        self.dtype = dtype
        self.copies = copies
        self.live: dict[Key, torch.Tensor] = {}
        # (flat storage, the copies' mark after its read)
        self._free: list[tuple[torch.Tensor, object]] = []
        # buffers that are autograd's gradients themselves: never pooled
        self._adopted: set[Key] = set()

    def get(
        self, key: Key, shape: tuple, device: torch.device, dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        """Bucket ``key``'s buffer, made the first time (``shape`` on ``device``, in ``dtype``:
        None, the pool's; contents undefined)."""
        if key not in self.live:
            self.live[key] = self._new_buffer(shape, device, dtype or self.dtype)
        return self.live[key]

    def adopt(self, key: Key, tensor: torch.Tensor) -> None:
        """Use ``tensor`` (a gradient nothing else aliases) as bucket ``key``'s buffer."""
        self.live[key] = tensor
        self._adopted.add(key)

    def adopted(self, key: Key) -> bool:
        """Bucket ``key``'s buffer is an adopted gradient (whole: nothing in it is unwritten)."""
        return key in self._adopted

    def _new_buffer(self, shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        i = self._reusable(numel, device, dtype)
        if i is None:
            return torch.empty(shape, dtype=dtype, device=device)
        store, read = self._free.pop(i)
        if read is not None and not read.query():
            # its download still reads it: the device waits, not the host
            self.copies.before_reuse(read)
        return store[:numel].view(shape)

    def _reusable(self, numel: int, device: torch.device, dtype: torch.dtype) -> Optional[int]:
        """The released buffer to carve a bucket from: the first big enough that no download reads
        any more, else, once those still read hold ``DOWNLOAD_BACKLOG_BYTES``, the oldest big
        enough; None: a new one."""
        fits = [
            i
            for i, (store, _) in enumerate(self._free)
            if store.numel() >= numel and store.dtype == dtype and store.device == device
        ]
        for i in fits:
            read = self._free[i][1]
            if read is None or read.query():
                return i
        held = sum(
            store.numel() * store.element_size() for store, read in self._free if read is not None
        )
        return fits[0] if fits and held >= self.DOWNLOAD_BACKLOG_BYTES else None

    def release(self, key: Key) -> None:
        """Bucket ``key`` is reduced and its piece handed on: keep its storage for the next bucket
        (an adopted gradient is dropped: pooling those would keep every one alive)."""
        buf = self.live.pop(key)
        if key in self._adopted:
            self._adopted.discard(key)
            return
        base = buf._base if buf._base is not None else buf
        self._free.append((base.view(-1), self.copies.reuse_marker()))

    def trim(self, keep: int) -> None:
        """End of backward. On a device the caching allocator keeps freed blocks for the next
        backward's buckets; the host's returns large blocks to the system, and taking them again
        faults every page in (21k page faults, 40 ms, per backward of an 84 MB bucket on CPU): there
        the largest ``keep`` released buffers stay, what a backward in the settled order holds at
        once."""
        host = sorted(
            (entry for entry in self._free if not reuses_freed_blocks(entry[0].device)),
            key=lambda e: -e[0].numel(),
        )
        self._free = host[:keep]

    def workspace(self) -> list[torch.Tensor]:
        """The released storage (holds no gradient)."""
        return [store for store, _ in self._free]
