"""Pinned host buffers sized exactly (offload/pinned.py): registered with the CUDA runtime at their exact
size and unregistered when freed, torch's pinned allocator when registration fails, counted by kind; the
count in memory_breakdown() and in the estimator.

CI has no GPU: the CUDA runtime is a fake that records each call (``pinned.RUNTIME``), and torch's
pinned allocator is the CPU stand-in of device_guard.py (``DeviceRulesMode``)."""

import gc
import logging

import pytest
import torch

from device_guard import DeviceRulesMode, run_on_meta
from zengine.checkpoint.native import background
from zengine.estimate import estimate
from zengine.offload import pinned

ODD = 3_000_011  # bytes: not a multiple of a page, nor of anything larger than 1 (5 GiB + 12345 in the issue)


class FakeCudart:
    """``torch.cuda.cudart()``'s two calls, recorded; ``fail``: cudaHostRegister returns an error."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: list[tuple[int, int, int]] = []  # (ptr, size, flags)
        self.unregistered: list[int] = []
        self.errors_cleared = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size, flags))
        return 1 if self.fail else 0  # cudaErrorInvalidValue

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:
        self.errors_cleared += 1
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "RUNTIME", fake)
    monkeypatch.setattr(pinned, "_warned", False)
    gc.collect()  # buffers of earlier tests are gone before this one counts
    return fake


def test_registers_the_exact_size_and_unregisters_when_the_last_view_goes(cudart):
    before = pinned.held_bytes()
    buf = pinned.empty(ODD, torch.uint8, kind="test")
    [(ptr, size, flags)] = cudart.registered
    assert (size, flags) == (ODD, 0) and ptr == buf.data_ptr() and ptr % pinned.PAGE == 0
    assert pinned.held_bytes("test") == ODD and pinned.held_bytes() == before + ODD
    view = buf[7:]
    del buf
    gc.collect()
    assert (
        cudart.unregistered == [] and pinned.held_bytes("test") == ODD
    )  # a view still uses the memory
    del view
    assert cudart.unregistered == [ptr] and pinned.held_bytes("test") == 0
    # typed and shaped, on a page (O_DIRECT's alignment): [250, 3] fp32 is 3000 bytes registered
    swap = pinned.zeros((250, 3), torch.float32, kind="test")
    assert (
        cudart.registered[-1][1:] == (3000, 0)
        and swap.shape == (250, 3)
        and float(swap.abs().sum()) == 0
    )
    plain = pinned.empty(
        ODD, torch.uint8, kind="test", pin=False
    )  # not asked to pin: nothing registered
    assert (
        len(cudart.registered) == 2 and pinned.held_bytes("test") == 3000 and plain.numel() == ODD
    )


def test_a_failed_registration_falls_back_to_torchs_allocator_once_said(cudart, caplog):
    cudart.fail = True
    with DeviceRulesMode(), caplog.at_level(logging.WARNING, logger="zengine"):
        first = pinned.empty(ODD, torch.uint8, kind="test")
        second = pinned.empty(1000, torch.float32, kind="test", align=4096)
        assert first.is_pinned() and second.is_pinned() and second.data_ptr() % 4096 == 0
    assert [size for _, size, _ in cudart.registered] == [ODD, 4000] and cudart.unregistered == []
    assert cudart.errors_cleared == 2  # the runtime's last error is not left for torch's next check
    assert sum("cudaHostRegister" in r.getMessage() for r in caplog.records) == 1
    # torch's caching allocator rounds up to a power of two: counted as it holds them
    assert pinned.held_bytes("test") == (1 << 22) + (1 << 13)
    del first, second
    assert pinned.held_bytes("test") == 0


def test_without_cuda_the_stand_in_pins_and_is_counted_exactly(monkeypatch):
    monkeypatch.setattr(pinned, "RUNTIME", False)  # as on a CPU-only torch
    with DeviceRulesMode():
        buf = pinned.empty(ODD, torch.uint8, kind="test")
        assert buf.is_pinned() and pinned.held_bytes("test") == ODD
    del buf
    assert pinned.held_bytes("test") == 0


def test_the_checkpoint_snapshot_is_pinned_once_for_every_save(cudart):
    tensors = [torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(ODD, dtype=torch.uint8)]
    views = background._SnapshotBuffer.views(tensors)
    assert [(v.shape, v.dtype) for v in views] == [(t.shape, t.dtype) for t in tensors]
    [(ptr, size, _)] = cudart.registered
    assert size == 64 + ODD + (-ODD % 64)  # each view on 64 bytes, one registration for the save
    del views  # the writer dropped the snapshot: the buffer waits for the next save, still pinned
    again = background._SnapshotBuffer.views(tensors)
    assert len(cudart.registered) == 1 and again[0].data_ptr() == ptr and cudart.unregistered == []
    del again
    background.release_snapshot_memory()  # engine.destroy()
    assert cudart.unregistered == [ptr] and pinned.held_bytes(pinned.SNAPSHOT) == 0


def _stage2_offload_on_meta() -> dict:
    """A stage-2 bf16 engine with its optimizer on the CPU, W = 1, on the stand-in device: the pinned count
    after two steps, and the bytes of the buffers the engine pinned."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import FakeCollectives, HostReads, side_streams_on_meta
    from models import EdgeNet

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 300,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        with (
            HostReads(1).installed(),
            FakeCollectives().installed(),
            side_streams_on_meta(),
            DeviceRulesMode(),
        ):
            with torch.device("meta"):
                model = EdgeNet()
            engine, *_ = zengine.initialize(model=model, config=cfg)
            for _ in range(2):
                x = torch.randint(0, 37, (2, 5), device="meta")
                engine.backward(engine(x, (x * 7 + 3) % 37))
                engine.step()
            opt = engine.optimizer
            staging = [host for host, _ in opt.placement.optimizer.copies.staging.values()]
            buffers = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(opt.masters) + list(opt.grads.shards) + staging
            }
            return {
                "breakdown": engine.memory_breakdown(),
                "buffers": sum(buffers.values()),
                "kinds": pinned.held(),
                "masters": sum(m.numel() for m in opt.masters),
                "staging": [(t.dtype, t.numel()) for t in staging],
            }
    finally:
        dist.destroy_process_group()


def test_memory_breakdown_counts_the_pinned_buffers_exactly():
    got = run_on_meta(_stage2_offload_on_meta)
    n = got["masters"]  # W = 1: this rank's shard is every trainable element
    assert got["kinds"] == {
        pinned.OPTIMIZER: 2 * 4 * n,
        pinned.STAGING: 2 * n,
    }  # fp32 masters + grads; bf16
    assert got["breakdown"]["pinned_host"] == got["buffers"] == 10 * n
    assert all(dtype == torch.bfloat16 for dtype, _ in got["staging"])


def test_the_estimator_counts_pinned_host_memory_at_exact_sizes():
    psi, world = ODD, 1
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    est = estimate(psi, cfg, world)
    # fp32 masters and gradient shard pinned (pin_memory's default), CPUAdam's moments pageable, bf16 staging
    assert est.pinned == {"master weights": 4 * psi, "gradients": 4 * psi, "copy staging": 2 * psi}
    assert est.pinned_host == 10 * psi and est.host_states == 18 * psi and "pinned" in est.format()
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    assert estimate(psi, cfg, world).pinned == {
        "copy staging": 2 * psi
    }  # staging is pinned regardless
    assert (
        estimate(psi, cfg, world, cpu_training=True).pinned == {}
    )  # the host is the device: nothing pinned
    nvme = {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 4}
    infinity = estimate(
        psi,
        {
            **cfg,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": nvme,
                "offload_param": {**nvme, "buffer_size": 10**6},
                "sub_group_size": 10**6,
            },
        },
        world,
    )
    assert set(infinity.pinned) == {
        "optimizer swap buffers",
        "parameter swap buffers",
        "parameters kept in memory",
        "gradient writes",
    }
    assert (
        infinity.pinned["parameter swap buffers"] == 2 * 4 * 10**6
    )  # bf16, 4 buffers of buffer_size
