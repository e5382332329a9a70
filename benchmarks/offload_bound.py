"""How fast an offloaded step could be: the bound bench_gpu.py reports its offload rows against.

With the optimizer (all of it, or ``offload_optimizer.ratio`` of it) on the host, a step needs three
things that can at best overlap completely:

- the device's own work: forward and backward (the same stage's row without offload measures it;
  its forward+backward time with ``--split``, else its whole step);
- the host's Adam over the offloaded elements (CPU-Adam's seconds per element, measured here on
  this host with zengine's kernel and the workers' thread count, times the elements);
- the link's traffic: at least each offloaded element's gradient down and its updated parameter up,
  in the compute dtype; with stage-3 parameter offload every parameter also goes up twice (the
  forward's and the backward's gathers). Divided by the link's pinned bandwidth measured here.

So the step can be no faster than the largest of the three: ``bound_s``. The report gives each term and
``bound_s / s_step`` (1.0: at the bound; the rest is what overlap and overheads lose). The traffic is a
lower bound (fp32 gradients, or a second pass, move more), so the bound is one too.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

ADAM_ELEMENTS = 1 << 24  # the host Adam timing's buffer: 16M elements (256 MiB of fp32 state)
LINK_BYTES = 1 << 28  # the link timing's buffer: 256 MiB


def host_adam_seconds_per_element(elements: int = ADAM_ELEMENTS, reps: int = 3) -> float:
    """Seconds per element of zengine's CPU-Adam (fp32 master, moments and gradient; bf16 copy out)."""
    from zengine.ops.adam import adam_step_

    param, grad = torch.randn(elements), torch.randn(elements)
    exp_avg, exp_avg_sq = torch.zeros(elements), torch.zeros(elements)
    out = torch.empty(elements, dtype=torch.bfloat16)
    times = []
    for step in range(1, reps + 2):
        began = time.perf_counter()
        adam_step_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=1e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.01,
            copy_out=out,
        )
        if step > 1:  # the first pass faults the pages in
            times.append(time.perf_counter() - began)
    return statistics.median(times) / elements


def link_bytes_per_second(device: torch.device, size: int = LINK_BYTES) -> Optional[dict]:
    """Pinned host <-> device copy rates (bytes/s), {"up": ..., "down": ...}; None without a device link."""
    if device.type != "cuda":
        return None
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    rates = {}
    for name, (dst, src) in {"up": (dev, host), "down": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)  # warm
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates[name] = 3 * size / (time.perf_counter() - began)
    del host, dev
    torch.cuda.empty_cache()
    return rates


def offload_share(name: str) -> Optional[tuple[float, bool]]:
    """(fraction of the optimizer on the host, whether the parameters live on the host too) of a
    bench_gpu row, or None for a row without host offload (NVMe rows are bounded by the disk: not here)."""
    if "-offload-r" in name:
        return float(name.rsplit("-r", 1)[1]), False
    if name.endswith("-offload"):
        return 1.0, name.startswith(("zengine-3", "deepspeed-3"))
    return None


def device_row(name: str) -> str:
    """The row without offload that measures the same stage's device work."""
    stage = name.split("-")[1]
    return f"zengine-{stage}"


def offload_bound(
    row: dict,
    device_s: Optional[float],
    adam_s_per_element: float,
    link: Optional[dict],
    compute_bytes: int = 2,
) -> Optional[dict]:
    """The bound of one offload row (``row``: bench_gpu's result), or None if it is not an offload row."""
    share = offload_share(row["name"])
    if share is None:
        return None
    ratio, params_on_host = share
    params = row["params"]
    host = ratio * params
    terms = {"device_s": device_s, "host_adam_s": host * adam_s_per_element, "link_s": None}
    if link is not None:
        down = host * compute_bytes  # gradients to the host
        up = host * compute_bytes + (2 * params * compute_bytes if params_on_host else 0)
        terms["link_s"] = down / link["down"] + up / link["up"]
    bound = max(v for v in terms.values() if v is not None)
    return dict(terms, bound_s=bound, of_bound=bound / row["s_step"])
