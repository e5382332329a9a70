"""Stage 3 cuts a model built elsewhere as it places it, one parameter at a time (#28 item 8).

``initialize`` used to move the whole model to the compute device and cut it there: a model that fits
the device only sharded failed with an out-of-memory before training began, unless it was built under
``zero.Init``. Now each parameter is moved, broadcast, cut and released in turn (``zero/place.py
place_model``). CI has no GPU, and a CPU parameter cannot be re-pointed at a stand-in device, so the
measure is taken on the CPU at W=4 (gloo): every tensor ``initialize`` makes is tracked, and the peak of
the live bytes among them must stay near a quarter of the model, where the old path copied all of it
(each parameter's full buffer, alive until the groups were built). On a GPU the same code path moves
each parameter to the device just before cutting it.
"""

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zengine
from harness import spawn

LAYERS, DIM, WORLD = 16, 64, 4


class LiveMade(TorchDispatchMode):
    """After every op: the bytes of the distinct storages still referenced by a tensor made inside the mode."""

    def __init__(self):
        super().__init__()
        self.made: list = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append(weakref.ref(t))
        storages = {}
        for ref in self.made:
            t = ref()
            if t is not None:
                s = t.untyped_storage()
                storages[s._cdata] = s.nbytes()
        self.peak = max(self.peak, sum(storages.values()))
        return out


def peak_made_bytes(stage: int) -> dict:
    torch.manual_seed(dist.get_rank())  # ranks start apart: initialize broadcasts rank 0's values
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)])  # fp32, built whole
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    with LiveMade() as live:
        engine, *_ = zengine.initialize(model=model, config=config)
    with engine.summon_full_params(writeback=False):  # every rank holds rank 0's model
        digest = float(sum(p.double().sum() for p in engine.module.parameters()))
    return {"peak": live.peak, "model": model_bytes, "largest": largest, "digest": digest}


def test_stage3_never_holds_the_whole_model_at_once():
    results = spawn(peak_made_bytes, WORLD, 3)
    for r in results:
        # this rank's shards (1/W of the model), the group buffer they are copied into (another 1/W; fp32 SGD
        # steps on the buffer itself), and a whole parameter in flight (measured: exactly 2/W of the model;
        # the old path: 1.25x the model)
        bound = 2 * r["model"] / WORLD + 2 * r["largest"]
        assert r["peak"] <= bound, (
            f"peak {r['peak']} B made, bound {bound:.0f} B, model {r['model']} B"
        )
    assert len({r["digest"] for r in results}) == 1, results  # cut from the same (rank 0's) values


def test_stage2_measure_sees_the_whole_model():
    """The measure itself: at stage 2 every rank makes a whole copy of the model (the flat parameter buffer)."""
    for r in spawn(peak_made_bytes, WORLD, 2):
        assert r["peak"] >= r["model"], r
