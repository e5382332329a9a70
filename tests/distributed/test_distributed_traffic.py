"""engine.comm_stats() (distributed/traffic.py): the bytes the engine's collectives move per step, by
collective and by whether the group spans nodes, equal what the ZeRO formulas say for the model."""

import torch
from torch import nn

import zengine
from harness import spawn
from zengine.distributed import traffic

STEPS = 3


def _traffic_run(stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 16), nn.Tanh(), nn.Linear(16, 5)
    )
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    engine, *_ = zengine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {
                "stage": stage,
                "stage3_param_persistence_threshold": 0,
                "stage3_max_reuse_distance": 0,
                "reduce_bucket_size": 200,
                "allgather_bucket_size": 200,
            },
        },
    )
    x = torch.randn(2, 16)
    for step in range(1 + STEPS):
        if step == 1:  # after the first step (which may set things up)
            engine.comm_stats(reset=True)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return {"psi": psi, "stats": engine.comm_stats(reset=True)}


def test_bytes_per_step_follow_the_zero_formulas():
    for stage, kind, gathers in ((2, traffic.INTRA, 1.0), (3, traffic.INTER, 2.0)):
        # 2 ranks on one "node" of 2, or on two "nodes" of 1
        out = spawn(
            _traffic_run, 2, stage, env={"LOCAL_WORLD_SIZE": "2" if kind == traffic.INTRA else "1"}
        )[0]
        psi, stats = out["psi"], out["stats"]
        assert set(stats) == {kind}, stats
        per = stats[kind]
        # on gloo stages 2-3 sum the gradients with an all-reduce of the whole model (plus a few bytes of step
        # statistics); stage 2 all-gathers the updated parameters once, stage 3 twice (forward, backward)
        assert abs(per["all_reduce"]["bytes"] / STEPS / psi - 1.0) < 0.1, (stage, per, psi)
        assert abs(per["all_gather"]["bytes"] / STEPS / psi - gathers) < 0.1 * gathers, (
            stage,
            per,
            psi,
        )
        assert per["all_reduce"]["ring_bytes"] == per["all_reduce"]["bytes"]  # 2 (W-1)/W = 1 at W=2
        assert traffic.total(stats) == sum(v["bytes"] for v in per.values())
