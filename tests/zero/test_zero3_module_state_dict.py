"""Stage 3: ``engine.module.state_dict()`` outside a gather returns the whole parameters (gathered,
a collective every rank makes), so ``torch.save`` of it loads into a plain model (issue 41 case 7:
it returned shape-(0,) tensors after a warning, a file no model could load)."""

import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, micro_batch

LR, GLOBAL = 1e-2, 4


def save_state_dict(path: str) -> dict:
    torch.manual_seed(0)
    model = EdgeNet()
    cfg = {
        "train_batch_size": GLOBAL,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30},
        "steps_per_print": 1000,
    }
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batches(1, GLOBAL)[0]
    engine.backward(engine(*micro_batch(batch, rank, world, GLOBAL // world, 0)))
    engine.step()
    state = engine.module.state_dict()  # outside any gather
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    with engine.summon_full_params(writeback=False):
        trained = {n: p.detach().clone().tolist() for n, p in engine.module.named_parameters()}
    shapes = {k: list(v.shape) for k, v in engine.module.state_dict().items()}  # a second call too
    return {"trained": trained, "shapes": shapes}


def test_stage3_module_state_dict_saves_and_loads(tmp_path):
    path = str(tmp_path / "model.pt")
    results = spawn(save_state_dict, 2, path)
    plain = EdgeNet()
    plain.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, whole shapes
    expected = {k: list(v.shape) for k, v in plain.state_dict().items()}
    for got in results:
        assert got["shapes"] == expected
        for name, p in plain.named_parameters():
            assert torch.equal(p.detach(), torch.tensor(got["trained"][name])), name
