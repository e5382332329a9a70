"""The offload copies overlap: gradients go down during backward, CPU-Adam runs piece by piece as they land,
and each piece's parameters go up while CPU-Adam works on the next (#28 item 1).

CI has no GPU, so each case trains on the stand-in device of ``device_guard.py`` (``meta``, torch's fake
process group at W = 2) with side streams that log every record, wait and host synchronize
(``StreamLog``), the copies issued on each stream and each CPU-Adam call. Its events land only when the
host waits for them, so whatever the host does not wait for is visibly still in flight. ``order_failures``
reads the log of a few steps and checks, for ZeRO-1, ZeRO-2 and ZeRO-3 (optimizer and parameters on the
host) with the optimizer on the host, and for ZeRO-1 and ZeRO-2 with its moments on NVMe (the pieces are the
swap file's chunks, stepped in one swap stream):

(a) every gradient copy to the host is issued on a side stream after an event recorded on the compute
    stream, is followed by an event on that stream, and nothing on the host waits for it during forward and
    backward; the compute stream waits for a download only where a bucket buffer is reused (``_new_buffer``);
(b) CPU-Adam on a piece starts after the host waited for that piece's newest download and no other, and
    the first piece starts while other downloads are still in flight (at one micro-step per step: the norm is
    summed on the device, so it does not wait for the copies);
(c) the upload of piece k is issued on a side stream after CPU-Adam on piece k and before CPU-Adam on piece
    k + 1, and the compute stream waits on the device for the last upload before the next forward;
(d) the host waits in the step only for: a piece's download (b), the upload a step ago from the same
    staging range (``copies.py:writable``, long landed), and with ``offload_param`` the gathers' uploads from
    the host shards it is about to write (``fetcher.py``, ``test_offload_stream_order.py``).

Each of four sabotages (settling every download at the end of backward, the compute stream waiting for each
download, stepping only once every download has landed, uploading after the whole step) breaks it.
"""

from __future__ import annotations

import contextlib

from configs import SHARD_ALL, cpu, ds_config, nvme, swap_dir

WORLD, STEPS = 2, 3
SUB_GROUP = 256  # elements per piece: several pieces per group of the edge model


def _config(stage: int, gas: int, offload_param: bool, moments: str) -> dict:
    """``moments``: "cpu", or "nvme" (chunks of 1024 elements: the decay group's 1,714 in 2 at W = 2)."""
    optimizer = cpu(pin_memory=True)
    if moments == "nvme":
        optimizer = nvme(swap_dir("zoverlap"), pin_memory=True)
    return ds_config(
        stage,
        "bf16",
        gas=gas,
        clip=0.5,
        steps_per_print=10**6,
        zero={"reduce_bucket_size": 300, "sub_group_size": SUB_GROUP, **SHARD_ALL},
        offload_optimizer=optimizer,
        offload_param=cpu(pin_memory=True) if offload_param else None,
    )


@contextlib.contextmanager
def _sabotage(name):
    """Take one part of the overlap out (restored on exit)."""
    from zengine.offload.copies import StreamCopies
    from zengine.offload.step_pipeline import StepPipeline
    from zengine.zero.bucket_buffers import BucketBuffers
    from zengine.zero.reducer import ShardReducer

    saved = []

    def patch(owner, attr, value):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    if (
        name == "no_backlog"
    ):  # not a sabotage: every reused bucket buffer waits for its download (on the device)
        patch(BucketBuffers, "DOWNLOAD_BACKLOG_BYTES", 0)
    elif (
        name == "settle_after_backward"
    ):  # the host waits for every download at the end of backward
        end = ShardReducer.end_backward
        patch(ShardReducer, "end_backward", lambda self: (end(self), self.landing.settle())[0])
    elif name == "compute_waits":  # the compute stream waits for each download as it is queued
        queue = StreamCopies._queue_down

        def queue_and_wait(self, dst, src):
            landing = queue(self, dst, src)
            self._compute().wait_event(landing.done)
            return landing

        patch(StreamCopies, "_queue_down", queue_and_wait)
    elif name == "step_after_all":  # CPU-Adam starts once every download has landed
        run = StepPipeline.run
        patch(
            StepPipeline,
            "run",
            lambda self, grads, *a: (self.copies.settle(), run(self, grads, *a))[1],
        )
    elif name == "upload_after_step":  # the pieces go up only after the whole step
        send, sent = StreamCopies.send_piece, StreamCopies.pieces_sent
        held = []
        patch(StreamCopies, "send_piece", lambda self, *piece: held.append(piece))

        def send_all(self):
            while held:
                send(self, *held.pop(0))
            sent(self)

        patch(StreamCopies, "pieces_sent", send_all)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def _train(stage: int, gas: int, offload_param: bool, sabotage) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import (
        DeviceRulesMode,
        FakeCollectives,
        HostReads,
        StreamLog,
        adam_logged,
        side_streams_on_meta,
    )
    from models import EdgeNet, edge_param_groups

    log, mode = StreamLog(), DeviceRulesMode()
    mode.watch = log.copy
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        with (
            HostReads(WORLD).installed(),
            FakeCollectives().installed(),
            side_streams_on_meta(log),
            adam_logged(log),
            _sabotage(sabotage),
            mode,
        ):
            with torch.device("meta"):
                model = EdgeNet()
            engine, *_ = zengine.initialize(
                model=model,
                config=_config(stage, gas, offload_param, "nvme" if sabotage == "nvme" else "cpu"),
                model_parameters=edge_param_groups(model, 1e-2),
            )
            for micro in range(STEPS * gas):
                x = torch.randint(0, 37, (2, 5), device="meta")
                log.add("forward", micro)
                loss = engine(x, (x * 7 + 3) % 37)
                log.add("backward", micro)
                engine.backward(loss)
                log.add("step", micro, micro % gas == gas - 1)
                engine.step()
            log.add("forward", STEPS * gas)  # (the next forward would start here)
        return {"ok": True, "entries": log.entries}
    except Exception as e:  # reported to the parent, which asserts on it
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()


def _overlaps(a, b) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def order_failures(entries: list[tuple], alone: bool) -> list[str]:
    """What in the log breaks (a)-(d) of the module doc. ``alone``: one micro-step per step, so each piece
    waits for its own downloads only and the first starts while others are in flight (with accumulation the
    norm needs the sums the host made, so every download lands before the first piece; only (a), (c), (d)
    and that no piece reads a gradient before it landed are checked then)."""
    out = []
    recorded = {}  # event -> (stream, index in entries)
    landed = set()  # events the host waited for, or older ones of their stream
    by_stream: dict[str, list[int]] = {}
    covers: dict[
        int, list
    ] = {}  # side-stream event -> host ranges of the copies it follows on its stream
    issued: dict[str, list] = {}  # stream -> host ranges of copies since its last event
    down_streams, up_streams = set(), set()
    downloads = set()  # done events of gradient downloads
    phase, step_start, boundary = None, None, False
    last_adam, waited_since_adam, first_adam_seen, uploaded_this_step = None, [], False, False
    pending_uploads = []  # copy-out ranges of this step's CPU-Adam calls whose upload is not issued yet
    last_upload = None  # event after this step's newest upload
    stage_events = set()  # events recorded before the current step (for the staging-reuse waits)
    sent = {
        e[3] for e in entries if e[0] == "copy" and e[1].startswith("h2d") and "copies.py" in e[4]
    }
    for i, e in enumerate(entries):
        kind = e[0]
        if phase is None and kind != "forward":
            continue  # building the engine (the masters made from the device's parameters) is not a step
        if kind in ("forward", "backward", "step"):
            if kind == "forward" and last_upload is not None:
                out.append(
                    f"forward {e[1]}: the compute stream never waited for upload event {last_upload}"
                )
            if kind == "forward":
                last_upload = None
            phase = kind
            if kind == "step":
                boundary, step_start = e[2], i
                last_adam, waited_since_adam, first_adam_seen, uploaded_this_step = (
                    None,
                    [],
                    False,
                    False,
                )
                stage_events = set(recorded)
            continue
        if kind == "record":
            _, ev, stream, site = e
            recorded[ev] = (stream, i)
            by_stream.setdefault(stream, []).append(ev)
            covers[ev] = issued.pop(stream, [])
            if stream in up_streams and phase == "step":
                last_upload = ev
        elif kind == "copy":
            _, ck, stream, host, site = e
            if ck.startswith("d2h"):
                if stream == "compute" or ck != "d2h_async":
                    out.append(f"entry {i}: a download {ck} on the {stream} stream at {site}")
                    continue
                down_streams.add(stream)
                before = [
                    x
                    for x in entries[:i]
                    if x[0] in ("wait", "copy") and x[1 if x[0] == "wait" else 2] == stream
                ]
                if (
                    not before
                    or before[-1][0] != "wait"
                    or recorded.get(before[-1][2], ("?",))[0] != "compute"
                ):
                    out.append(
                        f"entry {i}: a download on {stream} not after an event of the compute stream"
                    )
                after = next(
                    (x for x in entries[i + 1 :] if x[0] == "record" and x[2] == stream), None
                )
                if after is None:
                    out.append(f"entry {i}: no event after the download on {stream}")
                else:
                    downloads.add(after[1])
                issued.setdefault(stream, []).append(host)
            elif ck.startswith("h2d") and "copies.py" in site:
                if stream == "compute" or ck != "h2d_async":
                    out.append(f"entry {i}: an upload {ck} on the {stream} stream at {site}")
                    continue
                if (
                    phase == "step"
                    and not uploaded_this_step
                    and not any(
                        x[0] == "wait"
                        and x[1] == stream
                        and recorded.get(x[2], ("?",))[0] == "compute"
                        for x in entries[step_start:i]
                    )
                ):
                    out.append(
                        f"entry {i}: the step's first upload not after an event of the compute stream"
                    )
                up_streams.add(stream)
                uploaded_this_step = True
                issued.setdefault(stream, []).append(host)
                if pending_uploads and pending_uploads[0] == host:
                    pending_uploads.pop(0)
                elif host in pending_uploads:
                    out.append(f"entry {i}: uploads out of CPU-Adam's order")
                    pending_uploads.remove(host)
        elif kind == "wait":
            _, stream, ev, site = e
            if stream == "compute" and ev in downloads and "_new_buffer" not in site:
                out.append(
                    f"entry {i}: the compute stream waits for download event {ev} at {site} (not a reuse)"
                )
            if stream == "compute" and ev == last_upload:
                last_upload = None
        elif kind in ("stream_sync", "device_sync", "wait_stream"):
            out.append(f"entry {i}: {e}")
        elif kind == "sync":
            _, ev, site = e
            if phase in ("forward", "backward"):
                out.append(f"entry {i}: the host waits for event {ev} during {phase} ({site})")
            elif ev in downloads:
                waited_since_adam.append(ev)
            elif not (
                "fetcher.py" in site or (ev in stage_events and "copies.py:writable" in site)
            ):
                out.append(f"entry {i}: the host waits for event {ev} in the step at {site}")
            if ev in recorded:
                stream = recorded[ev][0]
                events = by_stream[stream]
                landed.update(events[: events.index(ev) + 1])
        elif kind == "adam":
            _, grad, copy_out = e
            if pending_uploads:
                out.append(
                    f"entry {i}: CPU-Adam on the next piece before the last piece's upload was issued"
                )
                pending_uploads = []
            mine = [ev for ev in downloads if any(_overlaps(h, grad) for h in covers.get(ev, []))]
            unlanded = [ev for ev in mine if ev not in landed]
            if unlanded:
                out.append(
                    f"entry {i}: CPU-Adam reads a gradient whose downloads {unlanded} have not landed"
                )
            strangers = [ev for ev in waited_since_adam if ev not in mine]
            if alone and strangers:
                out.append(f"entry {i}: CPU-Adam waited for downloads {strangers} of other pieces")
            if alone and len(waited_since_adam) > 1:
                out.append(
                    f"entry {i}: CPU-Adam waited for {len(waited_since_adam)} events, not its piece's one"
                )
            if alone and boundary and not first_adam_seen:
                in_flight = [ev for ev in downloads if ev not in landed and recorded[ev][1] < i]
                if not in_flight:
                    out.append(
                        f"entry {i}: the step's first CPU-Adam starts after every download landed"
                    )
            first_adam_seen = True
            waited_since_adam = []
            if (
                copy_out in sent and phase == "step"
            ):  # (not the host shards themselves: offload_param)
                pending_uploads.append(copy_out)
    if pending_uploads:
        out.append("the last pieces' uploads were never issued")
    return out


def _run_all(cases):
    return [_train(*case) for case in cases]


# (stage, gas, offload_param, tweak): "no_backlog" with every bucket buffer's reuse waiting for its download,
# "nvme" with Adam's moments on NVMe
TWEAKS = (None, "no_backlog", "nvme")
CASES = [
    (1, 1, False, None),
    (2, 1, False, None),
    (3, 1, False, None),
    (3, 1, True, None),
    (2, 2, False, None),
    (3, 1, False, "no_backlog"),
    (1, 1, False, "nvme"),
    (2, 1, False, "nvme"),
    (2, 2, False, "nvme"),
]
SABOTAGES = ["settle_after_backward", "compute_waits", "step_after_all", "upload_after_step"]


def test_copies_overlap_compute_and_cpu_adam():
    from device_guard import run_on_meta

    runs = CASES + [(2, 1, False, s) for s in SABOTAGES]
    results = run_on_meta(_run_all, runs, timeout=180)
    failures = []
    for (stage, gas, offload_param, sabotage), r in zip(runs, results):
        name = f"stage {stage} gas {gas}{' offload_param' if offload_param else ''}"
        assert r["ok"], f"{name} {sabotage}: {r['error']}"
        entries = r["entries"]
        found = order_failures(entries, alone=gas == 1)
        if sabotage in TWEAKS:
            failures += [f"{name} {sabotage or ''}: {f}" for f in found]
            reuses = [
                e for e in entries if e[0] == "wait" and e[1] == "compute" and "_new_buffer" in e[3]
            ]
            assert bool(reuses) == (sabotage == "no_backlog"), (name, sabotage, len(reuses))
            adams = [e for e in entries if e[0] == "adam"]
            uploads = [
                e
                for e in entries
                if e[0] == "copy" and e[1].startswith("h2d") and "copies.py" in e[4]
            ]
            assert len(adams) >= (3 if sabotage == "nvme" else 2) * STEPS, (name, len(adams))
            assert bool(uploads) != offload_param, (
                name
            )  # (offload_param: CPU-Adam writes the host shards)
        else:
            assert found, f"{name}: sabotage {sabotage} went unnoticed"
    assert not failures, "\n".join(failures)
