"""How much memory a rank will need, before training: model states and the transients of a step.

    from zengine.estimate import estimate
    print(estimate(model, "configs/zero2.json", world_size=8).format())

    python -m zengine.estimate --params 1.3e9 --world 8                 # every stage and offload choice
    python -m zengine.estimate --params 1.3e9 --world 8 --config ds.json  # that config only

Model states follow the ZeRO formulas for each stage, precision and offload (per element: parameters
in the compute dtype, gradients in the accumulate dtype (``zero/grad_dtypes.py``: by default fp32 at
stages 2-3, the compute dtype at 0-1) or fp32 where offloaded, fp32 masters unless the fp32 parameters
serve as their own, 8 bytes of Adam moments; with ``bf16.bf16_master_weights_and_grads`` bf16
masters and gradients, the bf16 parameters their own masters, and with ``bf16_optimizer_states`` 4
bytes of moments: 8 bytes per parameter in all), sharded over ``world_size`` ranks as the stage says. On
top come the transients this engine has during a step, each bounded by a config key
(``reduce_bucket_size`` and the buckets in flight, in the reduce dtype of ``communication_data_type``;
``stage3_max_live_parameters``, ``stage3_prefetch_bucket_size``) or by the largest parameter
(autograd's fresh gradient of the parameter in hand). Activations are the model's and are not counted.

"device" is the compute device and "host" the CPU memory that offload uses; on a CPU-only run they
are the same memory and add up. ``pinned`` is the part of "host" that is page-locked on a GPU machine
(what DeepSpeed's estimators call CPU memory for offload): the offloaded shards and swap buffers where
``pin_memory`` asks (the default), and the staging of the side-stream copies always. Each is pinned at
its exact size (``offload/pinned.py``), not rounded up to a power of two as torch's pinned allocator would.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from torch import nn

from .config import ZengineConfig, load_config
from .offload.infinity import record_dtypes
from .offload.partial import host_share
from .offload.state_swap import MAX_CHUNK
from .precision.masters import MasterPrecision
from .zero.bucket_buffers import BucketBuffers
from .zero.grad_dtypes import GradDtypes
from .zero.grads import buckets_in_flight
from .zero.stage3.units import GatherUnits
from .zero.sub_groups import split_sub_groups

GiB = 1 << 30


@dataclass
class MemoryEstimate:
    """Bytes one rank holds, by kind and place; ``peak_*`` adds the step's transients."""

    world_size: int
    stage: int
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    transients: dict[str, int] = field(default_factory=dict)  # on the compute device
    pinned: dict[str, int] = field(default_factory=dict)  # entries of ``host`` that are page-locked
    disk: dict[str, int] = field(default_factory=dict)  # NVMe offload's swap files, padding aside
    label: str = ""

    @property
    def device_states(self) -> int:
        return sum(self.device.values())

    @property
    def host_states(self) -> int:
        return sum(self.host.values())

    @property
    def disk_bytes(self) -> int:
        """Bytes of this rank's swap files (NVMe offload)."""
        return sum(self.disk.values())

    @property
    def pinned_host(self) -> int:
        """Page-locked host bytes (a part of ``host_states``), at their exact sizes."""
        return sum(self.pinned.values())

    @property
    def peak_device(self) -> int:
        """Model states on the compute device plus the largest set of transients alive at once."""
        return self.device_states + sum(self.transients.values())

    def format(self) -> str:
        """A few lines: per kind, then the totals."""
        lines = [
            f"ZeRO stage {self.stage}, {self.world_size} rank(s){' (' + self.label + ')' if self.label else ''}:"
        ]
        for where, kinds in (
            ("device", self.device),
            ("host", self.host),
            ("transient", self.transients),
            ("disk", self.disk),
        ):
            shown = ", ".join(f"{k} {v / GiB:.2f}" for k, v in kinds.items() if v)
            if shown:
                lines.append(f"  {where:9s} GiB: {shown}")
        lines.append(
            f"  per rank: device {self.device_states / GiB:.2f} GiB of states, peak "
            f"{self.peak_device / GiB:.2f} GiB with transients; host {self.host_states / GiB:.2f} GiB"
            + (f", {self.pinned_host / GiB:.2f} GiB of it pinned" if self.pinned_host else "")
            + (f"; disk {self.disk_bytes / GiB:.2f} GiB" if self.disk_bytes else "")
        )
        return "\n".join(lines)


def _numels(model: Union[nn.Module, int, float, Sequence[int]]) -> list[int]:
    if isinstance(model, nn.Module):
        return [p.numel() for p in model.parameters() if p.requires_grad]
    if isinstance(model, (int, float)):
        return [int(model)]
    return [int(n) for n in model]


def estimate(
    model: Union[nn.Module, int, float, Sequence[int]],
    config: Any = None,
    world_size: int = 1,
    largest_param: Optional[int] = None,
    cpu_training: bool = False,
    multi_parameter_modules: Optional[bool] = None,
) -> MemoryEstimate:
    """Per-rank memory for training ``model`` (a module, a parameter count, or the parameters' sizes)
    with ``config`` (a path, a dict or a ``ZengineConfig``; default: zengine's defaults, stage 0, fp32)
    on ``world_size`` ranks. ``largest_param`` (elements) defaults to the largest parameter given.
    ``cpu_training``: the compute device is the CPU, so CPU offload moves nothing (fp32 parameters
    stay their own masters and the gradient shard is the one the optimizer steps on).
    ``multi_parameter_modules``: whether some module owns several parameters stage 3 shards (read from
    ``model`` when it is a module; say it when giving sizes only)."""
    cfg = (
        config
        if isinstance(config, ZengineConfig)
        else load_config(
            config if config is not None else {"train_micro_batch_size_per_gpu": 1}, world_size
        )
    )
    zero = cfg.zero_optimization
    numels = _numels(model)
    psi = sum(numels)
    w = max(1, int(world_size))
    stage = zero.stage
    share = math.ceil(psi / w)  # this rank's shard of a flat buffer (padding aside)
    half = 2 if cfg.compute_dtype.itemsize == 2 else 4
    dtypes = GradDtypes.from_config(cfg)
    masters = MasterPrecision.from_config(cfg)  # fp32, or bf16 masters/grads (and moments)
    accum, wire = dtypes.accumulate.itemsize, dtypes.reduce.itemsize  # bytes per gradient element
    offload_opt = zero.offload_optimizer.device if zero.offload_optimizer.enabled else "none"
    offload_par = zero.offload_param.device if zero.offload_param.enabled else "none"
    if cpu_training:  # the host is the device: only NVMe moves anything (to the swap files)
        offload_par = "nvme" if offload_par == "nvme" else "none"
        offload_opt = "nvme" if offload_opt == "nvme" else "none"
    states_on_host = offload_opt != "none" and not cpu_training
    # ZeRO-Infinity (stage 3, optimizer on NVMe): the fp32 masters and gradient shards are swapped too
    infinity = stage == 3 and offload_opt == "nvme"
    persistent = (
        sum(n for n in numels if n < zero.stage3_param_persistence_threshold) if stage == 3 else 0
    )

    est = MemoryEstimate(
        w,
        stage,
        label=f"{'bf16/fp16' if half == 2 else 'fp32'}"
        f"{', ' + masters.describe() if masters.low else ''}"
        f"{', optimizer on ' + offload_opt if offload_opt != 'none' else ''}"
        f"{', parameters on ' + offload_par if offload_par != 'none' else ''}",
    )
    sharded_opt = share if stage >= 1 else psi  # elements of masters and moments this rank keeps
    # of which in host memory: all when offloaded, DeepSpeed's host sub-groups with ratio below 1
    host_opt = sharded_opt if states_on_host else 0
    if states_on_host and zero.offload_optimizer.partial:
        host_opt = _partial_host_elements(numels, w, zero)
    device_opt = sharded_opt - host_opt  # partial offload: the device share
    # stage 3, shards and masters on the device (all, or partial offload's device share): one tensor
    # is both, in the masters' dtype (the gathers cast; offload/placement.py shard_dtype)
    shared = device_opt if stage == 3 and offload_par == "none" else 0
    # parameters
    if stage < 3:
        est.device["parameters"] = half * psi
    else:
        whole = half * persistent * (w - 1) // w  # small parameters kept whole on every rank
        if offload_par == "nvme":  # the read pool, and the first max_in_cpu elements kept resident
            par = zero.offload_param
            largest_chunk = math.ceil((largest_param or max(numels, default=0)) / w)
            est.host["parameter swap buffers"] = (
                half * max(2, int(par.buffer_count)) * min(int(par.buffer_size), largest_chunk)
            )
            est.host["parameters kept in memory"] = half * min(int(par.max_in_cpu), share)
            est.disk["parameter swap file"] = half * share
        else:
            own = half * (share - shared) + masters.dtype.itemsize * shared
            (est.host if offload_par == "cpu" else est.device)["parameters"] = own
        est.device["persistent parameters"] = whole
    # gradients
    grad_elems = psi if stage < 2 else share
    if infinity:
        pass  # in the swap file; the transients below hold the buckets written behind
    elif states_on_host and stage >= 2:
        # the shard where the optimizer steps: fp32, or bf16 with bf16 masters; partial offload:
        # the device share's shard is fp32 too (DeepSpeed's)
        est.host["gradients"] = masters.grad_bytes * host_opt
        if device_opt:
            est.device["gradients"] = masters.grad_bytes * device_opt
    else:
        est.device["gradients"] = accum * grad_elems
        if states_on_host:
            est.host["gradients"] = masters.grad_bytes * share
    # masters: parameters of the masters' dtype serve as their own unless the optimizer moved
    # away (fp32 parameters; bf16 ones with bf16 masters), Kahan's compensation beside them
    if infinity:
        pass  # in the swap file, with the moments
    elif states_on_host:
        est.host["master weights"] = masters.master_bytes * host_opt
        if device_opt > shared and half != masters.dtype.itemsize:  # (partial, stages 1-2)
            est.device["master weights"] = masters.master_bytes * (device_opt - shared)
    elif shared:  # the parameters above; Kahan's compensation beside them
        if masters.master_bytes > masters.dtype.itemsize:
            est.device["master weights"] = (
                masters.master_bytes - masters.dtype.itemsize
            ) * sharded_opt
    elif half != masters.dtype.itemsize:
        est.device["master weights"] = masters.master_bytes * sharded_opt
    elif masters.rounding.buffers:
        est.device["master weights"] = (masters.master_bytes - half) * sharded_opt
    # Adam moments
    if offload_opt == "nvme":
        chunk = min(int(zero.sub_group_size), MAX_CHUNK, max(1, sharded_opt))
        count = min(
            int(zero.offload_optimizer.buffer_count), max(2, math.ceil(sharded_opt / chunk))
        )  # as offload/state_swap.py
        # bytes per element of a record: [exp_avg | exp_avg_sq] in the states' dtype or, ZeRO-Infinity,
        # [... | master | (Kahan's) | grad] in the masters' (fp32: 8 or 16; bf16: 4 or 8, Kahan 10)
        parts = (
            record_dtypes(masters.dtype, masters.states, bool(masters.rounding.buffers))
            if infinity
            else (masters.states,) * 2
        )
        record = sum(d.itemsize for d in parts)
        est.host["optimizer swap buffers"] = count * record * chunk
        est.disk["optimizer swap file"] = record * sharded_opt
        if (
            infinity
        ):  # gradient pieces written behind (swap.GradSwap.IN_FLIGHT): on a GPU machine pinned
            # and kept from step to step (registered once), so host memory for good
            writes = 4 * masters.grad_bytes * min(chunk, int(zero.reduce_bucket_size), share)
            (est.transients if cpu_training else est.host)["gradient writes"] = writes
    elif offload_opt == "cpu":
        est.host["optimizer states"] = masters.adam_state_bytes * host_opt
        if device_opt:
            est.device["optimizer states"] = masters.adam_state_bytes * device_opt
    else:
        est.device["optimizer states"] = masters.adam_state_bytes * sharded_opt
    if not cpu_training:
        offloaded = host_opt if offload_opt == "cpu" else sharded_opt  # (partial: the host share)
        _pinned(est, zero, half, offloaded, offload_opt, offload_par, infinity)
    # transients of a step
    largest = int(largest_param) if largest_param is not None else max(numels, default=0)
    est.transients["autograd gradient"] = half * largest
    # (stage 3 "auto": about a block's bucket, zero/stage3/units.py)
    units = GatherUnits.from_config(zero)
    bucket = min(units.reduce_bucket if stage == 3 else int(zero.reduce_bucket_size), psi)
    in_flight = buckets_in_flight(zero.overlap_comm, w)
    if stage < 2 and dtypes.reduce != dtypes.accumulate:
        # converted copies of the full buffer's buckets: those in flight and the one launching
        est.transients["gradient buckets"] = wire * bucket * (in_flight + 1)
    if stage == 2:
        # those in flight and the one launching
        est.transients["gradient buckets"] = wire * bucket * (in_flight + 1)
    if stage >= 2 and offload_opt == "cpu" and not cpu_training and host_opt:
        # on a GPU, reduced buckets whose copies to the host still run are kept until then (a backlog bounded by
        # BucketBuffers.DOWNLOAD_BACKLOG_BYTES, and by the whole gradient): the price of not waiting for them
        est.transients["gradient downloads"] = min(BucketBuffers.DOWNLOAD_BACKLOG_BYTES, wire * psi)
    if stage == 3:
        # those left in flight; a bucket reduced at once is the autograd gradient in hand (counted above)
        # unless the reduce dtype is another: then it is copied into a buffer of its own
        est.transients["gradient buckets"] = (
            wire * bucket * (in_flight + (not dtypes.grad_lands_in_bucket))
        )
        # gathered or being gathered (prefetch included): stage3_max_live_parameters bounds what is kept and
        # prefetched; the module about to run is fetched on top of it when needed
        # ("auto" keeps a used parameter only within the prefetch window: at most the window behind,
        # the window ahead and the module running)
        live = int(zero.stage3_max_live_parameters)
        if units.coalesce and int(zero.stage3_prefetch_bucket_size) > 0:
            live = min(live, units.reuse_distance + int(zero.stage3_prefetch_bucket_size))
        est.transients["gathered parameters"] = half * min(live + largest, psi)
        threshold = zero.stage3_param_persistence_threshold
        sharded = sum(1 for n in numels if n >= threshold)
        if (units.coalesce and sharded > 1) or (
            multi_parameter_modules
            if multi_parameter_modules is not None
            else _has_multi_parameter_modules(model, threshold)
        ):
            # a unit of several sharded parameters ("auto" units coalesce consecutive modules', a module
            # may own several) gathers through one staging buffer, then copies out
            est.transients["prefetch staging"] = half * min(
                int(zero.stage3_prefetch_bucket_size), psi
            )
    return est


def _partial_host_elements(numels: list[int], world: int, zero) -> int:
    """Shard elements of the host sub-groups under partial offload (``offload_optimizer.ratio``), the
    parameters taken as one param group, cut as stage 3 cuts them (``zero/sub_groups.py``,
    ``offload/partial.py``). A bare parameter count is taken as parameters finer than
    ``sub_group_size``: sub-groups of that size."""
    chunks = [math.ceil(n / world) for n in numels]
    if len(chunks) == 1:
        size = max(1, int(zero.sub_group_size))
        chunks = [size] * (chunks[0] // size) + ([chunks[0] % size] if chunks[0] % size else [])
    runs = split_sub_groups(chunks, int(zero.sub_group_size))
    on_host = host_share(len(runs), float(zero.offload_optimizer.ratio))
    return sum(chunks[i] for run, host in zip(runs, on_host) if host for i in run)


def _pinned(
    est: MemoryEstimate,
    zero,
    half: int,
    sharded_opt: int,
    offload_opt: str,
    offload_par: str,
    infinity: bool,
) -> None:
    """Add the host memory that is pinned on a GPU machine (the copy staging to ``host`` too), as
    ``offload/`` allocates it: shards and swap buffers where the section's ``pin_memory`` asks, the
    staging of side-stream copies always (``copies.StreamCopies``, ``state_swap.GradSwap``)."""
    pin_opt = offload_opt != "none" and bool(zero.offload_optimizer.pin_memory)
    pin_par = offload_par != "none" and bool(zero.offload_param.pin_memory)
    if pin_opt:
        for key in (
            "master weights",
            "gradients",
            "optimizer swap buffers",
        ):  # (CPUAdam's moments: pageable)
            if key in est.host:
                est.pinned[key] = est.host[key]
    if pin_par:
        for key in ("parameters", "parameter swap buffers", "parameters kept in memory"):
            if key in est.host:
                est.pinned[key] = est.host[key]
    if "gradient writes" in est.host:
        est.pinned["gradient writes"] = est.host["gradient writes"]
    if offload_opt != "none" and offload_par == "none":
        if (
            infinity
        ):  # each updated chunk goes up through 2 staging buffers (copies.StreamCopies.upload)
            chunk = min(int(zero.sub_group_size), MAX_CHUNK, max(1, sharded_opt))
            staging = 2 * half * chunk
        else:  # CPUAdam writes the compute-dtype parameters into one staging buffer per group
            staging = half * sharded_opt
        est.host["copy staging"] = est.pinned["copy staging"] = staging


def _has_multi_parameter_modules(model, threshold: int) -> bool:
    """True when some module owns more than one parameter that stage 3 shards (unknown without a module:
    False, as for a stack of bias-free layers)."""
    if not isinstance(model, nn.Module):
        return False
    return any(
        sum(1 for p in m.parameters(recurse=False) if p.requires_grad and p.numel() >= threshold)
        > 1
        for m in model.modules()
    )


def all_choices(
    model, world_size: int, base: Optional[dict] = None, largest_param: Optional[int] = None
) -> list[MemoryEstimate]:
    """Every stage and offload choice for ``model`` on ``world_size`` ranks (DeepSpeed's estimator table)."""
    base = dict(base or {"train_micro_batch_size_per_gpu": 1})
    out = []
    for stage, offloads in (
        (0, [{}]),
        (1, [{}, {"offload_optimizer": {"device": "cpu"}}]),
        (2, [{}, {"offload_optimizer": {"device": "cpu"}}]),
        (
            3,
            [
                {},
                {"offload_optimizer": {"device": "cpu"}},
                {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
            ],
        ),
    ):
        for extra in offloads:
            zero = {**base.get("zero_optimization", {}), "stage": stage, **extra}
            out.append(
                estimate(model, {**base, "zero_optimization": zero}, world_size, largest_param)
            )
    return out


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[MemoryEstimate]:
    """DeepSpeed's name: print (and return) the stage-1/2 choices for ``model``."""
    return _print([e for e in all_choices(model, num_gpus_per_node * num_nodes) if e.stage == 2])


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1
) -> list[MemoryEstimate]:
    """DeepSpeed's name: print (and return) the stage-3 choices for ``model``."""
    return _print([e for e in all_choices(model, num_gpus_per_node * num_nodes) if e.stage == 3])


def _print(estimates: list[MemoryEstimate]) -> list[MemoryEstimate]:
    for e in estimates:
        print(e.format())
    return estimates


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zengine.estimate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--params", type=float, required=True, help="trainable parameters (e.g. 1.3e9)"
    )
    parser.add_argument(
        "--largest",
        type=float,
        default=None,
        help="elements of the largest parameter (default: assume the embedding, params / 20)",
    )
    parser.add_argument(
        "--world", type=int, default=None, help="ranks in all (default: gpus x nodes)"
    )
    parser.add_argument("--gpus", type=int, default=1, help="ranks per node")
    parser.add_argument("--nodes", type=int, default=1, help="nodes")
    parser.add_argument(
        "--config", default=None, help="a DeepSpeed/zengine config: estimate that one only"
    )
    args = parser.parse_args(argv)
    world = args.world or args.gpus * args.nodes
    largest = int(args.largest) if args.largest else int(args.params) // 20
    if args.config:
        _print([estimate(int(args.params), args.config, world, largest_param=largest)])
    else:
        _print(all_choices(int(args.params), world, largest_param=largest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
