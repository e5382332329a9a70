"""Gradient shards dropped between steps (``offload/landing.py``): on a device with a caching
allocator a stage 2-3 gradient shard is made at a window's first reduction and dropped when the
gradients are zeroed, as FSDP2 sets gradients to None. CI has no such device, so here the host's
shards are dropped too (``kept_between_steps`` patched) and training must give the bits the kept
shards give: accumulation over the window (gas 3), clipping (the norm over a shard made mid-window),
a parameter no rank uses (its region never written: zero), and ``get_full_grad`` before the step.
The memory side is counted on the stand-in device (``test_zero3_device_memory.py``)."""

import pytest

from harness import spawn
from configs import ds_config
from models import train_edge_engine

STEPS, GAS = 3, 3


def _train(stage: int, precision: str, drop: bool):
    import zengine.offload.landing as landing

    if drop:
        landing.kept_between_steps = lambda shard: False
    config = ds_config(
        stage,
        precision,
        gas=GAS,
        clip=0.05,
        steps_per_print=10**6,
        zero={"reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
    )
    losses, params, _, _, _ = train_edge_engine(config, STEPS, GAS, 1e-2)
    return losses, {name: value.flatten().tolist() for name, value in params.items()}


def _both(stage: int, precision: str):
    import zengine.offload.landing as landing

    kept = _train(stage, precision, drop=False)
    original = landing.kept_between_steps
    try:
        dropped = _train(stage, precision, drop=True)
    finally:
        landing.kept_between_steps = original
    return kept, dropped


@pytest.mark.parametrize("stage,precision", [(2, "bf16"), (3, "bf16"), (3, "fp32")])
def test_dropped_gradient_shards_train_as_kept_ones(stage, precision):
    for kept, dropped in spawn(_both, 2, stage, precision):
        assert kept[0] == dropped[0], (kept[0], dropped[0])
        for name, value in kept[1].items():
            assert value == dropped[1][name], name  # the same bits
