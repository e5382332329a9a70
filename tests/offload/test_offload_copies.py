"""Offloaded gradients reach the host shard during backward; the CUDA side-stream copies (GPU only); the
ZeRO-Infinity gradient swap finishes pieces whose copies land late as if they had landed at once."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import SHARD_ALL, ds_config
from harness import spawn
from zengine.offload.copies import HostCopies, Landed, StreamCopies, make_copies
from zengine.offload.state_swap import GradSwap, StateSwapper
from zengine.ops.aio import AsyncIO

LAYERS, WIDTH = 6, 16


def _config(stage: int) -> dict:
    return ds_config(
        stage,
        micro_batch=4,
        zero={"reduce_bucket_size": 300, **SHARD_ALL},
        offload_optimizer="cpu",
        steps_per_print=1000,
    )


def streamed_during_backward(stage: int) -> tuple[int, int]:
    """(non-zero gradient-shard elements when the first layer's gradient is computed, after backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, *_ = zengine.initialize(model=model, config=_config(stage))
    shards = engine.optimizer.grads.shards
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 for s in shards)
    seen = []
    first = engine.module[0].weight
    # A tensor hook runs when autograd computes the gradient, before it is handed to the engine: the
    # first layer's gradient comes last in backward, so the later layers' buckets are done by then.
    first.register_hook(lambda g: seen.append(sum(int(s.count_nonzero()) for s in shards)) or g)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, WIDTH)
    loss = engine(x).square().mean()
    engine.backward(loss)
    after = sum(int(s.count_nonzero()) for s in shards)
    return seen[0], after


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_reach_the_host_shard_during_backward(stage):
    results = spawn(streamed_during_backward, 2, stage)
    during = sum(r[0] for r in results)
    after = sum(r[1] for r in results)
    total = LAYERS * (WIDTH * WIDTH + WIDTH)
    assert after == total  # every gradient element landed in exactly one rank's fp32 shard
    # Buckets of ~300 elements and at most two in flight: most of the later layers were already added.
    assert 0.4 * total < during < total


def test_cpu_device_copies_nothing():
    copies = make_copies(torch.device("cpu"))
    assert type(copies) is HostCopies
    shard = torch.zeros(5)
    piece = torch.arange(5, dtype=torch.bfloat16)
    copies.accumulate(shard, piece)
    copies.accumulate(shard, piece)
    copies.settle()
    assert shard.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    owned = torch.zeros(3, dtype=torch.bfloat16)
    assert copies.copy_out_target(0, owned) is owned  # CPUAdam writes the parameters in place


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_copies_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    copies = make_copies(device)
    assert isinstance(copies, StreamCopies)
    shard = torch.zeros(1 << 20, pin_memory=True)
    bucket = torch.empty(1 << 20, dtype=torch.bfloat16, device=device)
    for k in range(4):  # the compute stream rewrites the bucket right after each download is queued
        bucket.fill_(k + 1)
        copies.accumulate(shard, bucket)
    copies.settle()
    assert torch.all(shard == 10.0)
    owned = torch.zeros(1 << 20, dtype=torch.bfloat16, device=device)
    for k in range(3):
        copies.before_step()
        target = copies.copy_out_target(0, owned)
        assert target.device.type == "cpu" and target.is_pinned() and target.dtype == torch.bfloat16
        target.fill_(k + 1)
        copies.after_step()
        assert torch.all(owned == k + 1).item()  # the compute stream waited for the upload


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_download_and_upload_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    copies = make_copies(device)
    src = torch.empty(1 << 20, dtype=torch.bfloat16, device=device)
    hosts = [torch.empty(1 << 20, pin_memory=True) for _ in range(3)]
    landings = []
    for k, host in enumerate(
        hosts
    ):  # the device rewrites the source right after each download is queued
        src.fill_(k + 1)
        landings.append(copies.download(host, src))
    for k, (host, landing) in enumerate(zip(hosts, landings)):
        landing.synchronize()
        assert torch.all(host == k + 1)
    dst = torch.zeros(1 << 20, dtype=torch.bfloat16, device=device)
    value = torch.empty(1 << 20)
    for k in range(4):  # the host rewrites its source right after each upload is queued
        value.fill_(k + 1)
        copies.upload(dst, value)
        assert torch.all(dst == k + 1).item()  # the compute stream waited for the upload


class _LateCopies(HostCopies):
    """Downloads that land only when waited for (or after ``polls`` queries): the data arrives then."""

    def __init__(self, polls: int):
        self.polls = polls

    def download(self, dst, src):
        copies = self

        class Late(Landed):
            def __init__(self):
                self.src, self.asked = src.clone(), 0

            def query(self):
                self.asked += 1
                if self.src is not None and self.asked > copies.polls:
                    self.synchronize()
                return self.src is None

            def synchronize(self):
                if self.src is not None:
                    dst.copy_(self.src)
                    self.src = None

        return Late()


def _grad_swap_run(directory: str, copies) -> tuple[list[float], list[torch.Tensor]]:
    """Two accumulation windows over a [3000] gradient in chunks of 2048: whole, then a part again (added to
    what the file holds), then the next window replacing it. (The sums of squares, the gradient read back.)"""
    swap = GradSwap(
        StateSwapper(
            [3000, 1024], directory, 2048, 2, AsyncIO(1 << 14, 2), dtypes=(torch.float32,) * 4
        ),
        copies,
    )
    torch.manual_seed(0)
    pieces = [torch.randn(3000, dtype=torch.bfloat16) for _ in range(3)]
    sums, grads = [], []
    for window in range(2):
        totals = [
            swap.accumulate(0, 0, 3000, pieces[window]),
            swap.accumulate(1, 0, 1024, pieces[2][:1024]),
            swap.accumulate(0, 1024, 3000, pieces[2][1024:]),
        ]
        swap.flush()
        sums.append([float(t) for t in totals])
        grads.append((swap.read(0), swap.read(1)))
        swap.reset()
    swap.swapper.close()
    return sums, grads


@pytest.mark.parametrize("polls", [0, 1, 100])
def test_grad_swap_with_late_landings_matches_copies_in_order(tmp_path, polls):
    sums, grads = _grad_swap_run(str(tmp_path / "now"), HostCopies())
    late_sums, late_grads = _grad_swap_run(str(tmp_path / "late"), _LateCopies(polls))
    assert late_sums == sums
    for (a0, a1), (b0, b1) in zip(grads, late_grads):
        assert torch.equal(a0, b0) and torch.equal(a1, b1)
    torch.manual_seed(0)
    pieces = [torch.randn(3000, dtype=torch.bfloat16).float() for _ in range(3)]
    for window, (g0, g1) in enumerate(
        grads
    ):  # each window replaced the last; the part written twice is summed
        want = pieces[window].clone()
        want[1024:] += pieces[2][1024:]
        assert torch.equal(g0, want) and torch.equal(g1, pieces[2][:1024])


def offload_on_cuda(offload_param: bool) -> dict:
    from models import EdgeNet, edge_param_groups, make_batches, micro_batch, reference_run

    torch.manual_seed(0)
    model = EdgeNet()
    init = copy.deepcopy(model)
    batches = make_batches(4, 2)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        "steps_per_print": 1000,
    }
    if offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, 1e-2)
    )
    assert engine.device.type == "cuda"
    shards = [g.shard_flat for g in engine.optimizer.groups]
    assert all((s.device.type == "cpu" and s.is_pinned()) == offload_param for s in shards)
    for batch in batches:
        x, y = micro_batch(batch, 0, 1, 2, 0)
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        engine.step()
    with engine.summon_full_params(writeback=False):
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    _, ref = reference_run(init, batches, 1e-2, 0.5)
    return max((params[n] - ref[n]).abs().max().item() for n in ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offload_param", [False, True])
def test_stage3_offload_on_cuda_matches_the_reference(offload_param):
    # tests/conftest.py sets ZENGINE_DEVICE=cpu for every test; this one computes on the GPU over gloo
    assert spawn(offload_on_cuda, 1, offload_param, env={"ZENGINE_DEVICE": "cuda"})[0] <= 1e-5
