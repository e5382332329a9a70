"""``zengine.comm``: DeepSpeed's ``deepspeed.comm`` functions, called as scripts call them."""

import torch
import torch.distributed as dist

import zengine
from harness import spawn


def test_before_the_process_group_a_single_process_is_rank_0_of_1():
    assert not dist.is_initialized()
    assert zengine.comm.get_rank() == 0 and zengine.comm.get_world_size() == 1
    assert not zengine.comm.is_initialized()
    assert zengine.comm.ReduceOp.SUM == dist.ReduceOp.SUM


def _collectives_run():
    import zengine.comm as zdist

    rank, world = zdist.get_rank(), zdist.get_world_size()
    out = {
        "rank": rank,
        "world": world,
        "local": zdist.get_local_rank(),
        "init": zdist.is_initialized(),
        "backend": zdist.get_backend(),
    }
    t = torch.tensor([float(rank + 1)])
    zdist.all_reduce(t, op=zdist.ReduceOp.SUM, log_name="x", prof=False)
    out["sum"] = t.item()
    t = torch.tensor([float(rank + 1)])
    zdist.all_reduce(t, zdist.ReduceOp.MAX)
    out["max"] = t.item()
    parts = [torch.zeros(2) for _ in range(world)]
    zdist.all_gather(parts, torch.full((2,), float(rank)))
    out["gathered"] = [p.tolist() for p in parts]
    whole = torch.zeros(2 * world)
    zdist.all_gather_into_tensor(whole, torch.full((2,), float(rank)))
    out["into_tensor"] = whole.tolist()
    b = torch.tensor([float(rank * 10)])
    zdist.broadcast(b, src=world - 1)
    out["broadcast"] = b.item()
    r = torch.tensor([1.0])
    zdist.reduce(r, dst=0)
    out["reduce_on_0"] = r.item() if rank == 0 else None
    work = zdist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    zdist.barrier()
    out["ranks"] = zdist.get_all_ranks_from_group(zdist.get_world_group())
    return out


def test_collectives_on_three_ranks():
    results = spawn(_collectives_run, 3)
    for r, out in enumerate(results):
        assert (out["rank"], out["world"], out["local"], out["init"], out["backend"]) == (
            r,
            3,
            r,
            True,
            "gloo",
        )
        assert out["sum"] == 6.0 and out["max"] == 3.0
        assert out["gathered"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        assert out["into_tensor"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert out["broadcast"] == 20.0
        assert out["ranks"] == [0, 1, 2]
    assert results[0]["reduce_on_0"] == 3.0


def _init_distributed_run():
    # the harness started the group: DeepSpeed's init_distributed is then a no-op with its keywords
    import zengine.comm as zdist

    zdist.init_distributed(
        dist_backend="gloo",
        auto_mpi_discovery=True,
        distributed_port=29512,
        verbose=False,
        dist_init_required=None,
    )
    zengine.init_distributed("gloo", distributed_port=29512)
    return zdist.get_world_size()


def test_init_distributed_takes_deepspeeds_parameters():
    assert spawn(_init_distributed_run, 2) == [2, 2]
