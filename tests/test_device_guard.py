"""The step path never mixes devices, hands collectives host tensors, or reads the device mid-step.

CI has no GPU, so each case trains on the stand-in device of ``device_guard.py`` (``meta``, with
CUDA's device rules and torch's fake process group standing in for NCCL) and asserts: the run
finishes, every collective got device tensors only, and the host read the device exactly once per
boundary step. Two cases prove the guard fails on the bugs it is for: a norm accumulated on the host
(the first GPU crash zengine had) and a collective given a host tensor.
"""
import multiprocessing
import os
import tempfile


WORLD, GAS, STEPS = 2, 2, 3


def _config(stage, precision, offload):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                                 "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1500,
                                 "stage3_max_live_parameters": 4000}}
    zero = cfg["zero_optimization"]
    swap_dir = os.path.join(tempfile.gettempdir(), "zguard")
    if offload in ("cpu", "param", "param-nvme"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload in ("nvme", "infinity"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    if offload == "param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if offload in ("param-nvme", "infinity"):  # ZeRO-Infinity: parameter shards in a swap file
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir, "buffer_count": 3, "buffer_size": 4096,
                                 "pin_memory": True}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _run_case(stage, precision, offload, init, sabotage):
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import DeviceRulesMode, FakeCollectives, HostReads
    from models import EdgeNet, edge_param_groups

    if sabotage == "host_norm":  # the accumulator zengine once made with a default (host) device
        from zengine.zero.optimizer import ZeroOptimizer

        def host_norm(self, grads):
            acc = torch.zeros((), dtype=torch.float64)
            for g in grads:
                acc += torch.linalg.vector_norm(g, dtype=torch.float64).square()
            return acc
        ZeroOptimizer._sq_norm = host_norm
    if sabotage == "host_collective":
        from zengine.zero.flat_group import FlatParamGroup

        original = FlatParamGroup.publish
        FlatParamGroup.publish = lambda self, n, group=None: zengine.distributed.collectives.all_reduce_sum(torch.zeros(3), group) \
            or original(self, n, group)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    reads, collectives = HostReads(WORLD), FakeCollectives()
    try:
        with reads.installed(), collectives.installed(), DeviceRulesMode():
            if init:  # with parameter offload to NVMe, Init writes the shards to the swap file
                with zengine.zero.Init(config_dict_or_path=_config(stage, precision, offload)), torch.device("meta"):
                    model = EdgeNet()
            else:
                with torch.device("meta"):
                    model = EdgeNet()
            engine, *_ = zengine.initialize(model=model, config=_config(stage, precision, offload),
                                            model_parameters=edge_param_groups(model, 1e-2))
            assert engine.device.type == "meta"
            for _ in range(STEPS * GAS):
                x = torch.randint(0, 37, (2, 5), device="meta")
                loss = engine(x, (x * 7 + 3) % 37)
                engine.backward(loss)
                engine.step()
        devices = sorted({d for _, ds in collectives.calls for d in ds})
        return {"ok": True, "reads": reads.count, "steps": engine.global_steps, "devices": devices,
                "kinds": sorted({name for name, _ in collectives.calls})}
    except Exception as e:  # reported to the parent, which asserts on it
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()


def _child(cases, queue):
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ["ZENGINE_DEVICE"] = "meta"
    import torch
    torch.set_num_threads(1)
    queue.put([_run_case(*case) for case in cases])


def _run(cases):
    """Run the cases one after another in a fresh process (the guard patches module state)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(cases, queue))
    proc.start()
    try:
        return queue.get(timeout=240)
    finally:
        proc.join(timeout=10)


CASES = ([(s, p, "none", False, None) for s in (0, 1, 2, 3) for p in ("fp32", "bf16", "fp16")]
         + [(s, "bf16", o, False, None) for s in (1, 2, 3) for o in ("cpu", "nvme")]
         + [(3, "bf16", "param", False, None), (3, "fp32", "none", True, None)]
         + [(3, p, o, i, None) for p, o, i in (("bf16", "param-nvme", False), ("fp16", "infinity", False),
                                                ("bf16", "infinity", True))])


def test_step_path_stays_on_the_device_with_one_host_read_per_step():
    results = _run(CASES)
    failures = [f"stage {c[0]} {c[1]} offload={c[2]} init={c[3]}: {r.get('error') or r}"
                for c, r in zip(CASES, results)
                if not (r["ok"] and r["reads"] == STEPS and r["steps"] == STEPS and r["devices"] == ["meta"])]
    assert not failures, "\n".join(failures)
    kinds = {k for r in results for k in r["kinds"]}
    assert {"all_gather_flat", "reduce_scatter_flat", "reduce", "all_reduce"} <= kinds  # NCCL's paths ran


def test_guard_catches_a_host_norm_and_a_host_collective():
    [host_norm] = _run([(1, "fp32", "none", False, "host_norm")])  # one process each: sabotage patches classes
    [host_collective] = _run([(1, "fp32", "none", False, "host_collective")])
    assert not host_norm["ok"] and "DeviceMixError" in host_norm["error"] and "cpu" in host_norm["error"]
    assert not host_collective["ok"] and "WrongDeviceError" in host_collective["error"]
    assert "all_reduce_sum" in host_collective["error"]
