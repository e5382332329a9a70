"""An offloaded step taken in pieces as its gradients land (``offload/step_pipeline.py``) computes what the step
taken whole computes, bit for bit.

On a GPU the pieces run when the copies have side streams; here the host stands in for the device with
copies that defer like those (``LateCopies``: each download lands only when the host waits for it, or for a
later one, or after a few polls), so the CPU run takes the pieces path with real data: many pieces
(``sub_group_size`` 100) in landing order, each scaled, clipped and stepped by CPU-Adam on its own runs,
gradient accumulation summing late pieces in launch order. Without gradient clipping the parameters, the
optimizer states and their step counts equal the whole step's exactly; with clipping the norm is summed by
region (on a GPU, on the device) in another order, so they agree to rounding.

With the moments on NVMe (``SwappedAdam``) the pieces are the swap file's chunks, stepped in landing order in
one swap stream a step: the moments (read inside ``states_in_memory``), Kahan's compensation of bf16
masters and the masters equal the whole step's alike.
"""

import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import nvme, swap_dir
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, micro_batch
from zengine.offload.arrivals import Arrivals
from zengine.offload.copies import HostCopies, Landed

STEPS, MICRO, WORLD = 3, 2, 1


class _Late(Landed):
    """A copy that lands when waited for (with every copy queued before it) or after ``polls`` queries."""

    def __init__(self, queue: list, dst: torch.Tensor, src: torch.Tensor, polls: int):
        self.queue, self.dst, self.src, self.polls = queue, dst, src, polls
        queue.append(self)

    def query(self) -> bool:
        self.polls -= 1
        if self.polls < 0 and self.src is not None:
            self.synchronize()
        return self.src is None

    def synchronize(self) -> None:
        while self.src is not None:  # the older ones land first, as on one stream
            first = self.queue.pop(0)
            first.dst.copy_(first.src)
            first.src = None


class LateCopies(HostCopies):
    """Host copies that defer like ``StreamCopies``: each download lands late (``_Late``)."""

    defers = True

    def __init__(self, polls: int):
        self.arrivals, self.queue, self.polls = Arrivals(), [], polls
        self.ranges_settled = 0  # the step in pieces settles one range per piece

    def accumulate(self, shard_slice, piece, overwrite=False):
        staging = None if overwrite else torch.empty(piece.shape, dtype=shard_slice.dtype)
        landing = _Late(
            self.queue, shard_slice if overwrite else staging, piece.detach().clone(), self.polls
        )
        self.arrivals.add(landing, staging, shard_slice, overwrite)
        self.arrivals.poll()

    def settle(self):
        self.arrivals.settle()

    def settle_range(self, view):
        self.ranges_settled += 1
        self.arrivals.settle_range(view)

    def arrival(self, view):
        return self.arrivals.arrival(view)


def _mlp() -> nn.Module:
    """Every parameter used: the step writes the bf16 parameters while stepping (copy-out)."""
    return nn.Sequential(nn.Embedding(37, 23), nn.Linear(23, 41), nn.Tanh(), nn.Linear(41, 37))


class _Loss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x).float().view(-1, 37), y.view(-1))


def _train(model_name: str, stage: int, gas: int, clip: float, offload: str, late):
    """(parameters, optimizer states, masters, norms) after STEPS steps; ``late``: polls of the deferred
    copies, None: the host's own copies (the step taken whole). ``offload``: "cpu", "param", "param-nvme", "partial",
    "nvme" (the moments swapped, fp32 masters) or "nvme-bf16" (bf16 masters and moments, Kahan)."""
    import zengine.offload.placement as placement

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet() if model_name == "edge" else _Loss(_mlp())
    groups = edge_param_groups(model, 1e-2)
    zero = {
        "stage": stage,
        "reduce_bucket_size": 300,
        "sub_group_size": 100,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu"},
    }
    if offload == "param":
        zero["offload_param"] = {"device": "cpu"}
    if offload == "param-nvme":  # the shards in a swap file, each piece written as it is stepped
        zero["offload_param"] = nvme(swap_dir("zpieces_param"), buffer_count=3, buffer_size=4096)
    if offload == "partial":  # half the sub-groups (of 100 elements) stepped by torch's Adam
        zero["offload_optimizer"]["ratio"] = 0.5
    if offload.startswith("nvme"):  # chunks of 1024 (fp32) or 2048 (bf16) elements: several a group
        zero["offload_optimizer"] = nvme(swap_dir("zpieces"), buffer_count=4)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": True},
        "steps_per_print": 10**6,
        "zero_optimization": zero,
    }
    if stage == 1 and offload == "nvme":
        # the summed gradient in the fp32 masters' dtype: the host's own takes the pieces path (on a GPU
        # the pieces of the device's bf16 sum are converted as they are copied down)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if offload == "nvme-bf16":
        cfg["bf16"].update(
            bf16_master_weights_and_grads=True, bf16_optimizer_states=True, master_rounding="kahan"
        )
    original = placement.make_copies
    if late is not None:
        placement.make_copies = lambda device: LateCopies(late)
    try:
        engine, *_ = zengine.initialize(model=model, config=cfg, model_parameters=groups)
    finally:
        placement.make_copies = original
    copies = engine.optimizer.placement.optimizer.copies
    copies = getattr(copies, "host", copies)  # partial offload: the host share's (PartialCopies)
    assert copies.defers == (late is not None)
    opt = engine.optimizer
    streams = _count_streams(opt.optimizer)
    written = _count_piece_writes(opt.placement.params)
    norms = []
    for batch in make_batches(STEPS, MICRO * gas * world):
        for m in range(gas):
            x, y = micro_batch(batch, dist.get_rank(), world, MICRO, m)
            engine.backward(engine(x, y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    if offload.startswith("nvme"):  # one swap stream a step, whole or in pieces
        assert streams == [STEPS], streams
    with engine.summon_full_params(writeback=False):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    with opt.optimizer.states_in_memory():  # (NVMe: the moments read from the swap file)
        states = [
            {
                k: (v.clone() if torch.is_tensor(v) else v)
                for k, v in opt.optimizer.state[sp].items()
            }
            for sp in opt.shard_params
        ]
    masters = [m.clone() for m in opt.masters]
    # the optimizer's pieces: 100 elements (NVMe shards: whole 4 KiB blocks), or the swap file's chunks
    size = opt.master_store.piece_size()
    pieces = sum(len(opt.optimizer.piece_bounds(sp, size)) for sp in opt.shard_params)
    assert pieces >= 3, pieces
    if late is not None:  # a range settled per piece per step, every copy landed and added
        assert copies.ranges_settled >= pieces * STEPS, (copies.ranges_settled, pieces)
        assert not copies.queue and not copies.arrivals.pending
    if offload == "param-nvme":  # each piece's parameters written to the file as it was stepped
        assert written == [pieces * STEPS if late is not None else 0], (written, pieces)
    engine.destroy()
    return params, states, masters, norms


def _count_piece_writes(params_home) -> list[int]:
    """[how many pieces the step wrote to the parameters' home as they were stepped], counted."""
    count = [0]
    stepped = params_home.piece_stepped

    def counted(*args):
        count[0] += 1
        return stepped(*args)

    params_home.piece_stepped = counted
    return count


def _count_streams(optimizer) -> list[int]:
    """[how many swap streams ``optimizer`` (NVMe) runs from now on], counted as they run."""
    count = [0]
    swapper = getattr(optimizer, "swapper", None)
    if swapper is not None:
        stream = swapper.stream

        def counted(*args, **kwargs):
            count[0] += 1
            return stream(*args, **kwargs)

        swapper.stream = counted
    return count


# (model, stage, accumulation steps, gradient clipping, offload): the edge model has unused parameters (the
# step by runs, parameters written after it), the MLP none (CPU-Adam writes the bf16 parameters as it steps)
CASES = [
    ("edge", 2, 3, 0.0, "cpu"),
    ("mlp", 2, 1, 0.0, "cpu"),
    ("mlp", 3, 3, 0.0, "cpu"),
    ("edge", 3, 1, 0.0, "param"),
    # stage-3 shards on NVMe: pieces of whole 4 KiB blocks (2048 bf16), written to the file as stepped
    ("mlp", 3, 3, 0.0, "param-nvme"),
    ("edge", 3, 1, 0.5, "param-nvme"),
    ("mlp", 2, 3, 0.5, "cpu"),
    ("edge", 3, 3, 0.0, "partial"),
    ("mlp", 3, 1, 0.5, "partial"),
    # NVMe (SwappedAdam): the pieces are its chunks, 4 + 1 (fp32) or 2 + 1 (bf16) a step
    ("mlp", 1, 1, 0.0, "nvme"),
    ("edge", 1, 3, 0.5, "nvme"),
    ("mlp", 2, 3, 0.0, "nvme"),
    ("edge", 2, 1, 0.5, "nvme"),
    ("mlp", 2, 1, 0.0, "nvme-bf16"),
    ("mlp", 1, 3, 0.5, "nvme-bf16"),
    ("edge", 2, 3, 0.0, "nvme-bf16"),
]


def _compare(cases) -> list[str]:
    out = []
    for case in cases:
        whole = _train(*case, late=None)
        for polls in (
            1,
        ):  # the oldest lands at the second poll (backward polls at each piece), the rest when waited for
            pieces = _train(*case, late=polls)
            exact = case[3] == 0.0
            for name, a in whole[0].items():
                b = pieces[0][name]
                if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)):
                    out.append(
                        f"{case} polls {polls}: {name} differs by {(a - b).abs().max().item():.3g}"
                    )
            for sa, sb in zip(whole[1], pieces[1]):
                for key in sa:
                    same = (
                        torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key]))
                        if exact
                        else torch.allclose(
                            torch.as_tensor(sa[key]).float(),
                            torch.as_tensor(sb[key]).float(),
                            rtol=1e-4,
                            atol=1e-7,
                        )
                    )
                    if not same:
                        out.append(f"{case} polls {polls}: optimizer state {key} differs")
            if exact and not all(torch.equal(a, b) for a, b in zip(whole[2], pieces[2])):
                out.append(f"{case} polls {polls}: masters differ")
            # the norm is summed by region, unscaled then times the factor squared: equal to rounding (of
            # bf16 gradients, with accumulation: the whole step's are scaled by 1/gas, rounded, then summed)
            bound = 1e-3 if case[4] == "nvme-bf16" else 1e-6
            if max(abs(a - b) / a for a, b in zip(whole[3], pieces[3])) > bound:
                out.append(f"{case} polls {polls}: norms {whole[3]} vs {pieces[3]}")
    return out


def test_a_step_in_pieces_equals_the_step_taken_whole():
    failures = spawn(_compare, WORLD, CASES)
    assert failures == [[]] * WORLD, failures
