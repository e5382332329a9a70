"""The contenders bench_zero.py runs side by side, each built in a worker as a ``Trainer``: DDP, torch's
ZeroRedundancyOptimizer, FSDP2, zengine stages 0-3 (fp32, bf16, offload) and DeepSpeed ZeRO 1-3, with
the settings they share (model, learning rate, buckets, DeepSpeed's stage-3 defaults), the ZeRO paper's
per-rank memory formulas they are held to, and the micro-batch every contender reads at a step.
bench_compile.py and bench_memory.py build on the same pieces."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from common import REPO

sys.path.insert(0, str(REPO))

from zengine.models import ByteWindows  # noqa: E402

MB = 1024 * 1024
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
MICRO_BATCH = 4
BUCKET = 50_000_000  # default reduce/all-gather bucket (elements) for zengine and DeepSpeed alike
# Stage-3 settings for zengine-3 and deepspeed-3 alike (DeepSpeed's defaults, which are zengine's too).
STAGE3 = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


# -- what each contender is ---------------------------------------------------------------------
@dataclass
class Trainer:
    """One contender, built in a worker. A training step is ``loss = forward_backward(x, y)`` then
    ``optimizer_step()``; ``state_bytes()``, called between the two, counts the model states this rank
    holds at that moment, when gradients and optimizer states are both alive."""

    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer_step: Callable[[], None]
    state_bytes: Callable[[], int]
    note: str = ""
    # Elements of whole (gathered) parameters this rank holds when state_bytes() is called; 0 unless the
    # contender shards parameters (stage 3, FSDP2) and then keeps some whole (persistent small ones).
    gathered_numel: Callable[[], int] = lambda: 0


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]


def torch_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )


def whole_param_numel(model: torch.nn.Module) -> int:
    """Elements of the parameters that are whole on this rank right now. A released zengine-3 or DeepSpeed-3
    parameter shows an empty tensor; an FSDP2 parameter is registered as a sharded DTensor while resharded."""
    from torch.distributed.tensor import DTensor

    return sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))


def torch_steps(ddp, opt):
    """forward_backward and optimizer_step of a DDP-wrapped model and its optimizer."""

    def forward_backward(x, y):
        loss = ddp(x, y)
        loss.backward()
        return loss

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, optimizer_step


def torch_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    return unique_bytes([*params, *(p.grad for p in params), *optimizer_state_tensors(opt)])


def build_ddp(model: torch.nn.Module, bucket: int) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = torch_adamw(ddp.parameters())
    return Trainer(
        *torch_steps(ddp, opt),
        lambda: torch_state_bytes(model, opt),
        "params + grads + AdamW state; DDP's reducer buckets not counted",
    )


def build_zero_redundancy(model: torch.nn.Module, bucket: int) -> Trainer:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(
        ddp.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        fused=True,
    )
    return Trainer(
        *torch_steps(ddp, opt),
        lambda: torch_state_bytes(model, opt.optim),
        "params + grads + this rank's AdamW state; DDP's reducer buckets not counted",
    )


# Optimizer offload variants: where Adam's states go (None: on the device, which is the CPU here too).
OFFLOAD = {
    None: None,
    "cpu": {"device": "cpu"},
    "nvme": {
        "device": "nvme",
        "nvme_path": os.path.join(tempfile.gettempdir(), "zengine_bench_nvme"),
        "buffer_count": 4,
    },
}


def zero_config(stage: int, bucket: int, offload: str | None = None) -> dict:
    """The config zengine and DeepSpeed both get (DeepSpeed's optimizer section is ignored unless it
    offloads: it gets a client optimizer)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            **(STAGE3 if stage == 3 else {}),
        },
    }
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = OFFLOAD[offload]
        cfg["zero_optimization"]["sub_group_size"] = (
            2**20
        )  # NVMe: 4 buffers x 8 B x 1M elements = 32 MiB
    return cfg


def build_zengine(stage: int, offload: str | None = None, cpu_matmul: str | None = None):
    """zengine at ``stage``; ``cpu_matmul`` set: in bf16 with that ``bf16.cpu_matmul`` ("native", "fp32")."""

    def build(model: torch.nn.Module, bucket: int) -> Trainer:
        import zengine
        from zengine.engine.engine import model_state_bytes

        config = zero_config(stage, bucket, offload)
        if cpu_matmul is not None:
            config["bf16"] = {"enabled": True, "cpu_matmul": cpu_matmul}
        engine, optimizer, _, _ = zengine.initialize(model=model, config=config)
        inner = getattr(optimizer, "optimizer", optimizer)
        fused = getattr(inner, "defaults", {}).get("fused")

        def forward_backward(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            return loss

        trainer = Trainer(
            forward_backward,
            engine.step,
            lambda: model_state_bytes(engine.memory_breakdown()),
            f"engine.memory_breakdown(); optimizer {type(inner).__name__}(fused={fused})",
            lambda: whole_param_numel(model),
        )
        fetcher = getattr(
            engine.optimizer, "fetcher", None
        )  # stage 3: the engine's own gather accounting
        if fetcher is not None:

            def state_bytes():
                trainer.note = (
                    f"engine.memory_breakdown(); optimizer {type(inner).__name__}(fused={fused}); "
                    f"most gathered at once during the step (engine accounting, persistent ones "
                    f"left out): {fetcher.peak_live_numel:,} elements"
                )
                return model_state_bytes(engine.memory_breakdown())

            trainer.state_bytes = state_bytes
        return trainer

    return build


def tensors_reachable(obj, depth: int = 4, seen=None) -> list[torch.Tensor]:
    """Tensors held by ``obj``'s attributes, lists and dicts, ``depth`` levels down."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        return [obj]
    if (
        depth < 0
        or id(obj) in seen
        or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.nn.Module))
    ):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        children = list(obj.values()) + [k for k in obj if torch.is_tensor(k)]
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_reachable(child, depth - 1, seen)]


def build_deepspeed(stage: int, offload: str | None = None):
    def build(model: torch.nn.Module, bucket: int) -> Trainer:
        import deepspeed

        if offload is None:
            config = {k: v for k, v in zero_config(stage, bucket).items() if k != "optimizer"}
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=torch_adamw(model.parameters()), config=config
            )
        else:  # offload wants DeepSpeed's own CPU Adam, built from the config's optimizer section
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=zero_config(stage, bucket, offload),
            )

        def forward_backward(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            return loss

        def state_bytes():
            params = list(engine.module.parameters())
            shards = [
                p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None
            ]  # stage 3
            return unique_bytes(
                [*params, *shards, *(p.grad for p in params), *tensors_reachable(optimizer)]
            )

        return Trainer(
            forward_backward,
            engine.step,
            state_bytes,
            "params"
            + (" (whole ones) + their partitions (ds_tensor)" if stage == 3 else "")
            + " + grads + every tensor reachable from the ZeRO optimizer (4 levels of attributes)",
            lambda: whole_param_numel(engine.module),
        )

    return build


def build_fsdp2(model: torch.nn.Module, bucket: int) -> Trainer:
    """FSDP2: fully_shard each transformer block (one all-gather / reduce-scatter unit each), then the root
    (embeddings, tied head, final norm). Defaults otherwise: fp32, reshard after forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch_adamw(model.parameters())

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def state_bytes():
        params = list(model.parameters())
        return unique_bytes(
            [
                local(t)
                for t in [*params, *(p.grad for p in params), *optimizer_state_tensors(opt)]
                if t is not None
            ]
        )

    return Trainer(
        *torch_steps(model, opt),
        state_bytes,
        "local shards of params + grads + AdamW state (DTensor.to_local()); whole parameters if any",
        lambda: whole_param_numel(model),
    )


CONTENDERS: dict[str, tuple[Callable, str]] = {
    # name: (builder, which ZeRO memory formula applies)
    "ddp": (build_ddp, "ddp"),
    "zero-redundancy": (build_zero_redundancy, "os"),
    "zengine-0": (build_zengine(0), "ddp"),
    "zengine-1": (build_zengine(1), "os"),
    "zengine-2": (build_zengine(2), "os+g"),
    "zengine-3": (build_zengine(3), "p+os+g"),
    "fsdp2": (build_fsdp2, "p+os+g"),
    "deepspeed-1": (build_deepspeed(1), "os"),
    "deepspeed-2": (build_deepspeed(2), "os+g"),
    "deepspeed-3": (build_deepspeed(3), "p+os+g"),
    # optimizer offload (the "device" is the CPU here, so the formulas are unchanged except for NVMe)
    "zengine-2-offload": (build_zengine(2, "cpu"), "os+g"),
    "zengine-2-nvme": (build_zengine(2, "nvme"), "os+g-nvme"),
    "deepspeed-2-offload": (build_deepspeed(2, "cpu"), "os+g"),
    # bf16 (formulas are fp32's: not applied), torch's bf16 GEMM or fp32 products (bf16.cpu_matmul)
    **{
        f"zengine-{s}-bf16-{label}": (build_zengine(s, cpu_matmul=mode), "bf16")
        for s in (2, 3)
        for label, mode in (("native", "native"), ("fp32mm", "fp32"))
    },
}
BF16_SET = [
    "zengine-2",
    "zengine-2-bf16-native",
    "zengine-2-bf16-fp32mm",
    "zengine-3",
    "zengine-3-bf16-native",
    "zengine-3-bf16-fp32mm",
]


def formula_bytes(kind: str, numel: int, world: int, gathered: int = 0) -> float:
    """ZeRO paper's per-rank model-state bytes for fp32 Adam (params 4, grads 4, Adam moments 8 per element);
    with parameters partitioned too (stage 3), plus 4 bytes per element of the parameters held whole."""
    return {
        "ddp": 16 * numel,
        "os": 8 * numel + 8 * numel / world,
        "os+g": 4 * numel + 12 * numel / world,
        "p+os+g": 16 * numel / world + 4 * gathered,
        "os+g-nvme": 4 * numel + 4 * numel / world,
        "bf16": float("nan"),
    }[kind]


FORMULA_TEXT = {
    "ddp": "16Ψ",
    "os": "8Ψ+8Ψ/W",
    "os+g": "4Ψ+12Ψ/W",
    "p+os+g": "16Ψ/W+4·gathered",
    "os+g-nvme": "4Ψ+4Ψ/W (+swap buffers; moments on disk)",
    "bf16": "fp32 formulas n/a",
}


# -- the data every contender reads ----------------------------------------------------------------
def batch_for(
    dataset: ByteWindows, step: int, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of global step ``step``: the same windows for every contender."""
    first = (step * world + rank) * MICRO_BATCH
    items = [dataset[(first + j) % len(dataset)] for j in range(MICRO_BATCH)]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
