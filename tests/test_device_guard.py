"""The step path never mixes devices, hands collectives host tensors, or waits for the device mid-step.

CI has no GPU, so each case trains on the stand-in device of ``device_guard.py`` (``meta``, with
CUDA's device rules, its side streams and pinned host memory, and torch's fake process group standing
in for NCCL) and asserts: the run finishes, every collective got device tensors only, the host read the
device exactly once per boundary step, and every copy between the device and the host in a step is
one the host does not wait for (pinned and non_blocking), in the exact number ``expected_copies``
gives. Four cases prove the guard fails on the bugs it is for: a norm accumulated on the host (the
first GPU crash zengine had), a collective given a host tensor, a gradient read to the host in the
step and an upload from pageable memory.
"""

from configs import SHARD_ALL, SMALL_BUCKETS, cpu, ds_config, nvme, swap_dir


WORLD, GAS, STEPS = 2, 2, 3
SYNC_KINDS = ("d2h_sync", "h2d_blocking", "h2d_pageable")  # device_guard.SYNC_KINDS: the host waits
PARTIAL_SUB_GROUP = (
    150  # partial offload: EdgeNet's two param groups cut into 7 sub-groups at W = 2
)
# NVMe offload at stages 1-2: chunks of 1024 fp32 moments (one O_DIRECT block), the step's pieces: the decay
# group's shard (1,714 elements at W = 2) in 2, the vectors' (70) in 1
NVME_SUB_GROUP = 1024
GATHERS = "zengine/zero/stage3/gather.py"  # where host-resident shards are copied into the gathers


def _config(stage, precision, offload):
    swap = swap_dir("zguard")
    optimizer = param = None
    if offload in ("cpu", "param", "param-nvme"):
        optimizer = cpu(pin_memory=True)
    if offload == "partial":  # half the sub-groups on the device (offload/partial.py)
        optimizer = cpu(pin_memory=True, ratio=0.5)
    if offload in ("nvme", "infinity"):
        optimizer = nvme(swap, pin_memory=True)
    if offload == "param":
        param = cpu(pin_memory=True)
    if offload in ("param-nvme", "infinity"):  # ZeRO-Infinity: parameter shards in a swap file
        param = nvme(swap, buffer_count=3, buffer_size=4096, pin_memory=True)
    return ds_config(
        stage,
        precision,
        gas=GAS,
        clip=0.5,
        steps_per_print=10**6,
        zero={
            **SMALL_BUCKETS,
            **SHARD_ALL,
            "stage3_prefetch_bucket_size": 1500,
            "stage3_max_live_parameters": 4000,
            **({"sub_group_size": PARTIAL_SUB_GROUP} if offload == "partial" else {}),
            **({"sub_group_size": NVME_SUB_GROUP} if offload == "nvme" and stage < 3 else {}),
        },
        offload_optimizer=optimizer,
        offload_param=param,
    )


def _run_case(stage, precision, offload, init, sabotage):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import DeviceRulesMode, FakeCollectives, HostReads, side_streams_on_meta
    from models import EdgeNet, edge_param_groups

    if sabotage == "host_norm":  # the accumulator zengine once made with a default (host) device
        from zengine.zero.optimizer import ZeroOptimizer

        def host_norm(self, grads):
            acc = torch.zeros((), dtype=torch.float64)
            for g in grads.tensors:
                acc += torch.linalg.vector_norm(g, dtype=torch.float64).square()
            return acc

        ZeroOptimizer._sq_norm = host_norm
    if sabotage == "host_collective":
        from zengine.zero.flat_group import FlatParamGroup

        original = FlatParamGroup.publish
        FlatParamGroup.publish = lambda self, n, group=None: (
            zengine.distributed.collectives.all_reduce_sum(torch.zeros(3), group)
            or original(self, n, group)
        )
    if sabotage in ("grad_to_host", "pageable_upload"):  # copies the host waits for, in the step
        from zengine.zero.optimizer import ZeroOptimizer

        original_sq = ZeroOptimizer._sq_norm

        def sq_norm(self, grads):
            if (
                sabotage == "grad_to_host"
            ):  # a gradient read on the host (a debugging print, a check)
                grads.tensors[0].cpu()
                return original_sq(self, grads)
            # a value made on the host and uploaded from pageable memory
            return original_sq(self, grads) + torch.zeros((), dtype=torch.float64).to(
                self.device, non_blocking=True
            )

        ZeroOptimizer._sq_norm = sq_norm
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    reads, collectives, mode = HostReads(WORLD), FakeCollectives(), DeviceRulesMode()
    steps = []  # per boundary step, forward and backward included: {"kinds", "sites", "reads"}
    try:
        with reads.installed(), collectives.installed(), side_streams_on_meta(), mode:
            if init:  # with parameter offload to NVMe, Init writes the shards to the swap file
                with (
                    zengine.zero.Init(config_dict_or_path=_config(stage, precision, offload)),
                    torch.device("meta"),
                ):
                    model = EdgeNet()
            else:
                with torch.device("meta"):
                    model = EdgeNet()
            engine, *_ = zengine.initialize(
                model=model,
                config=_config(stage, precision, offload),
                model_parameters=edge_param_groups(model, 1e-2),
            )
            assert engine.device.type == "meta"
            mode.copies.window()  # from the first forward on
            for micro in range(STEPS * GAS):
                x = torch.randint(0, 37, (2, 5), device="meta")
                loss = engine(x, (x * 7 + 3) % 37)
                engine.backward(loss)
                engine.step()
                if micro % GAS == GAS - 1:
                    kinds, sites = mode.copies.window()
                    done = sum(s["reads"] for s in steps)
                    steps.append({"kinds": kinds, "sites": sites, "reads": reads.count - done})
        devices = sorted({d for _, ds in collectives.calls for d in ds})
        return {
            "ok": True,
            "reads": reads.count,
            "steps": engine.global_steps,
            "devices": devices,
            "kinds": sorted({name for name, _ in collectives.calls}),
            "copies": steps,
            "host_states": engine.memory_breakdown()["host_states"],
        }
    except Exception as e:  # reported to the parent, which asserts on it
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()


def _run_cases(cases):
    return [_run_case(*case) for case in cases]


def _run(cases):
    """Run the cases one after another in a fresh process (the guard patches module state)."""
    from device_guard import run_on_meta

    return run_on_meta(_run_cases, cases)


CASES = (
    [(s, p, "none", False, None) for s in (0, 1, 2, 3) for p in ("fp32", "bf16", "fp16")]
    + [(s, "bf16", o, False, None) for s in (1, 2, 3) for o in ("cpu", "nvme")]
    + [(3, "bf16", "param", False, None), (3, "fp32", "none", True, None)]
    + [(3, p, "partial", False, None) for p in ("bf16", "fp32")]
    + [
        (3, p, o, i, None)
        for p, o, i in (
            ("bf16", "param-nvme", False),
            ("fp16", "infinity", False),
            ("bf16", "infinity", True),
        )
    ]
)


def expected_copies(stage: int, offload: str, step: int) -> dict:
    """The copies between the device and the host in boundary step ``step`` (0-based; GAS micro-steps and
    the step) of a case, by kind; the host waits for none of them, except the step's one read (``reads``).

    The copies into the gathers of shards kept in host memory (offload_param) are not counted here: how
    many there are follows the fetch policy (prefetch, live parameters); that they are all pinned and
    non_blocking is what the absence of the waiting kinds checks.
    """
    counts = {
        "reads": 1,  # the boundary step's one host read of the summed control values (step_stats.py)
        "h2d_async": 1,
    }  # that vector's header, uploaded from pinned memory
    # -- down: offloaded gradients land in pinned host memory, copied on a side stream ----------------
    # EdgeNet at W = 2, reduce_bucket_size 300: the buckets holding part of this rank's shard, once per
    # micro-step (GAS = 2) as each is reduced.
    if stage == 1 and offload != "none":
        # the summed gradient's owned slice of each param group, at the step, in pieces of sub_group_size:
        # one a group, or with NVME_SUB_GROUP the decay group's 1,714 elements in 2 (masters.py)
        counts["d2h_async"] = 3 if offload == "nvme" else 2
    if stage == 2 and offload != "none":
        counts["d2h_async"] = 3 * GAS  # 3 buckets intersect this rank's shard
    if stage == 3 and offload in ("cpu", "param"):
        counts["d2h_async"] = (
            6 * GAS
        )  # 6 buckets (of 150 shard elements), each with a row for this rank
    if stage == 3 and offload == "partial":
        # ratio 0.5 over 5 sub-groups of 150 shard elements: emb.weight and fc1.weight stay on the
        # device (int(0.5 x 5) = 2), fc2.weight, unused.weight + mix.weight and the vectors go to the
        # host; only their buckets' rows cross, 4 a micro-step (the device share's add in place)
        counts["d2h_async"] = 4 * GAS
    if stage == 3 and offload in ("nvme", "param-nvme", "infinity"):
        # each parameter's shard aligned to a 4 KiB O_DIRECT block: every one of the 11 is its own bucket
        # (optimizer on NVMe, ZeRO-Infinity: the bucket's row goes to the gradient swap, offload/state_swap.py)
        counts["d2h_async"] = 11 * GAS
        if offload == "nvme" and step == 0:
            counts["d2h_async"] += (
                2  # ZeRO-Infinity's first step: each group's one never-stepped chunk's
            )
            #                           master comes from the parameters on the device (offload/infinity.py)
    # -- up: the updated compute-dtype parameters, from pinned staging on a side stream ---------------
    if offload == "cpu":
        counts["h2d_async"] += (
            2  # CPUAdam's copy-out staging in pieces of sub_group_size: one per param group (copies.py)
        )
    if offload == "nvme" and stage < 3:
        # the step in the swap file's chunks (NVME_SUB_GROUP), each sent up from SwappedAdam's staging as it
        # is stepped (offload/step_pipeline.py): the decay group's 2 and the vectors' 1
        counts["h2d_async"] += 3
    if offload == "partial":
        # the step in pieces of sub_group_size (150): the host sub-groups' 472, 346 and 73 elements in
        # 4 + 3 + 1 pieces, each sent up from CPU-Adam's staging as it is stepped; the device share
        # (stepped first, on the device) writes its parameters in place
        counts["h2d_async"] += 8
    if stage == 3 and offload == "nvme":
        counts["h2d_async"] += (
            2  # ZeRO-Infinity's write-back of each group's one chunk (infinity.py)
        )
    #   (offload_param: CPUAdam writes the host shard itself, or the step writes the swap file)
    # -- waits the engine should not have --------------------------------------------------------------
    return counts


def seen_copies(step: dict) -> dict:
    """A step's copies by kind as ``expected_copies`` counts them (gathers from host memory left out)."""
    counts = {"reads": step["reads"]}
    for (kind, site), n in step["sites"].items():
        if not (kind == "h2d_async" and site.startswith(GATHERS)):
            counts[kind] = counts.get(kind, 0) + n
    return counts


def copy_failures(case, result) -> list[str]:
    """What is wrong with a case's copies, step by step, naming the sites of those the host waits for."""
    out = []
    for i, step in enumerate(result["copies"]):
        want, got = expected_copies(case[0], case[2], i), seen_copies(step)
        if got != want:
            waits = sorted(
                f"{kind} at {site} x{n}"
                for (kind, site), n in step["sites"].items()
                if kind in SYNC_KINDS
            )
            out.append(f"step {i}: copies {got}, expected {want}; the host waits for: {waits}")
    return out


def test_step_path_stays_on_the_device_with_one_host_read_per_step():
    results = _run(CASES)
    failures = [
        f"stage {c[0]} {c[1]} offload={c[2]} init={c[3]}: {r.get('error') or r}"
        for c, r in zip(CASES, results)
        if not (
            r["ok"] and r["reads"] == STEPS and r["steps"] == STEPS and r["devices"] == ["meta"]
        )
    ]
    assert not failures, "\n".join(failures)
    kinds = {k for r in results for k in r["kinds"]}
    assert {
        "all_gather_flat",
        "reduce_scatter_flat",
        "reduce",
        "all_reduce",
    } <= kinds  # NCCL's paths ran
    failures = [
        f"stage {c[0]} {c[1]} offload={c[2]} init={c[3]}: {f}"
        for c, r in zip(CASES, results)
        for f in copy_failures(c, r)
    ]
    assert not failures, "\n".join(failures)


# EdgeNet's trained shard elements at W = 2 by sub-group (sub_group_size 150): emb.weight 426, fc1.weight 472
# on the device at ratio 0.5; fc2.weight 472, unused.weight + mix.weight 346, the vectors 73 on the host
HOST_SHARE, ALL = 472 + 346 + 73, 426 + 472 + 472 + 346 + 73


def test_memory_breakdown_counts_the_host_share_of_partial_offload():
    cases = [(3, "bf16", "cpu", False, None), (3, "bf16", "partial", False, None)]
    whole, partial = _run(cases)
    assert whole["ok"] and partial["ok"], (whole, partial)
    # fp32 gradient shard, master and Adam's two moments: 16 bytes per element in host memory
    assert whole["host_states"] == 16 * ALL
    assert partial["host_states"] == 16 * HOST_SHARE


def test_guard_catches_a_host_norm_and_a_host_collective():
    [host_norm] = _run(
        [(1, "fp32", "none", False, "host_norm")]
    )  # one process each: sabotage patches classes
    [host_collective] = _run([(1, "fp32", "none", False, "host_collective")])
    assert (
        not host_norm["ok"]
        and "DeviceMixError" in host_norm["error"]
        and "cpu" in host_norm["error"]
    )
    assert not host_collective["ok"] and "WrongDeviceError" in host_collective["error"]
    assert "all_reduce_sum" in host_collective["error"]


def test_guard_counts_a_gradient_read_to_the_host_and_a_pageable_upload():
    for sabotage, kind in (("grad_to_host", "d2h_sync"), ("pageable_upload", "h2d_pageable")):
        case = (1, "fp32", "none", False, sabotage)
        [result] = _run([case])
        assert result["ok"], result
        failures = copy_failures(case, result)
        assert len(failures) == STEPS, (
            failures
        )  # one more copy, the host waiting for it, in every step
        assert all(
            f"'{kind}': 1" in f and f"{kind} at zengine/zero/optimizer.py" in f for f in failures
        ), failures
