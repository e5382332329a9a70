"""Host shards the device reads are not rewritten before the reads finish; events sit on the compute stream
(#28 items 7 and 4).

With ``offload_param`` the stage-3 gathers upload each rank's shard from host memory (``non_blocking``),
and CPU-Adam then writes those shards in place at the step. On a GPU that was safe only because the
step's one host read happened to wait for the device first. Now the fetcher records an event after the
uploads and the step waits on it before anything is written; and the NVMe swap's slot events are recorded
on the compute device's stream, not the current device's (``zero.Init`` never sets the current device).

CI has no GPU, so the stand-in device of ``device_guard.py`` (``meta``) gets side streams whose events
log what they do: the test asserts the order of record, synchronize and the optimizer's update.
"""

import inspect
import os

from configs import SHARD_ALL, cpu, ds_config, nvme, swap_dir

WORLD, GAS, STEPS = 2, 2, 2


def _config(offload: str) -> dict:
    param = (
        cpu(pin_memory=True)
        if offload == "param"
        else nvme(
            swap_dir("zorder"), buffer_count=3, buffer_size=4096, pin_memory=True, max_in_cpu=0
        )
    )
    return ds_config(
        3,
        "bf16",
        gas=GAS,
        steps_per_print=10**6,
        zero={"reduce_bucket_size": 300, **SHARD_ALL, "stage3_prefetch_bucket_size": 1500},
        offload_optimizer=cpu(pin_memory=True),
        offload_param=param,
    )


def _run_case(offload: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import DeviceRulesMode, FakeCollectives, HostReads
    from models import EdgeNet, edge_param_groups
    from zengine.accelerator import CpuAccelerator, _HostStream
    from zengine.offload import copies

    log: list = []

    def site() -> str:
        for frame in inspect.stack()[2:]:
            if "zengine" in frame.filename and "accelerator" not in frame.filename:
                return os.path.basename(frame.filename)
        return "?"

    class Stream(_HostStream):
        def __init__(self, name: str):
            super().__init__()
            self.name = name

    compute = Stream("compute")

    class Event:
        count = 0

        def __init__(self, *args, **kwargs):
            Event.count += 1
            self.id = Event.count

        def record(self, stream=None):
            log.append(("record", self.id, site(), stream.name if stream is not None else None))

        def synchronize(self):
            log.append(("synchronize", self.id, site()))

        def query(self):
            return True

        def wait(self, stream=None):
            pass

    class LoggingStreams(CpuAccelerator):
        """Side streams for the stand-in device whose events say where and on which stream they are recorded."""

        @property
        def Stream(self):  # noqa: N802
            return lambda *a, **k: Stream("side")

        @property
        def Event(self):  # noqa: N802
            return Event

        def current_stream(self, device_index=None):
            return compute

    from zengine.ops.adam import CPUAdam

    def logged(original):
        def step(self, *args, **kwargs):
            log.append(("update",))
            return original(self, *args, **kwargs)

        return step

    for name in ("step", "step_with_copy", "step_runs"):  # whichever the step path calls
        setattr(CPUAdam, name, logged(getattr(CPUAdam, name)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    copies.SIDE_STREAMS["meta"] = LoggingStreams()
    try:
        with HostReads(WORLD).installed(), FakeCollectives().installed(), DeviceRulesMode():
            with torch.device("meta"):
                model = EdgeNet()
            engine, *_ = zengine.initialize(
                model=model,
                config=_config(offload),
                model_parameters=edge_param_groups(model, 1e-2),
            )
            for _ in range(STEPS * GAS):
                x = torch.randint(0, 37, (2, 5), device="meta")
                engine.backward(engine(x, (x * 7 + 3) % 37))
                engine.step()
        return {"ok": True, "log": log}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        del copies.SIDE_STREAMS["meta"]
        dist.destroy_process_group()


def _run(offload: str) -> dict:
    from device_guard import run_on_meta

    return run_on_meta(_run_case, offload, timeout=180)


def test_the_step_waits_for_uploads_from_host_shards_before_writing_them():
    r = _run("param")
    assert r["ok"], r.get("error")
    log = r["log"]
    updates = [i for i, e in enumerate(log) if e[0] == "update"]
    assert updates, "no optimizer update logged"
    for u in updates:
        reads = [e for e in log[:u] if e[0] == "record" and e[2] == "fetcher.py"]
        assert reads, "no event after the uploads from host shards"
        last = reads[-1]
        assert last[3] == "compute", (
            last
        )  # recorded on the compute stream, after the uploads it orders
        waited = [e for e in log[log.index(last) : u] if e[0] == "synchronize" and e[1] == last[1]]
        assert waited, f"the step wrote the host shards without waiting for event {last[1]}"


def test_swap_slot_events_are_recorded_on_the_compute_stream():
    r = _run("param-nvme")
    assert r["ok"], r.get("error")
    slots = [e for e in r["log"] if e[0] == "record" and e[2] == "param_swap.py"]
    assert slots, "no swap slot event recorded"
    assert all(e[3] == "compute" for e in slots), slots  # not the current device's stream (None)
