"""The runs behind tests/cuda: every one takes the compute device as a parameter.

On a GPU machine the tests run them in ONE process per group with NCCL at world size 1 on cuda:0
(``spawn_backend``); ``test_cpu_side.py`` runs the same functions on the CPU with gloo, so the test
logic itself is exercised on a machine without a GPU.

Every case collects its failures as strings instead of raising, so one process checks many cases
and the parametrized tests report each case by name. A result is plain Python (it crosses a queue).

What is checked (each against the plain torch reference computed on the SAME device):

- ``parity_case``: stage x precision x optimizer/parameter offload x gradient accumulation; the
  parameters after training (fp32: within 1e-5 of the reference movement and 1e-5 absolute; 16-bit
  within the tolerances of tests/zero/test_zero_parity.py), the losses, the fp32 global norms,
  frozen and unused parameters untouched, and where everything lives: the module's parameters on
  the compute device in every forward and after every step, masters/optimizer states/gradient
  shards on the device without offload and on the host with it.
- ``overflow_case``: an fp16 step whose gradient is not finite (an Inf injected into one gradient,
  or a huge loss scale) is skipped: parameters, masters and optimizer states unchanged, the loss
  scale halved, ``was_step_applied()`` False; the next step applies.
- ``init_case``: a model built inside ``zengine.zero.Init`` has its shards on the device, trains
  like the reference, and does not stay gathered between steps (persistence threshold 0);
  ``GatheredParameters(modifier_rank=0)`` writes land in the shards (before the engine, and after
  it: then in the fp32 masters too).
- ``checkpoint_roundtrip``: a checkpoint saved on the device loads on two CPU gloo ranks and the
  run continues with the losses of an uninterrupted run on the device; and the other way round.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import (
    EdgeNet,
    edge_param_groups,
    make_batches,
    micro_batch,
    reference_run,
    train_global_batch,
)
from zengine.engine.engine import model_state_bytes
from zengine.zero.stage3.param import ParamState, lookup

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str, path: str):
    """A module of the CPU suite, loaded from its file under a private name (so that pytest's own import
    of the same file, when the whole suite runs, is not disturbed)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# One source of truth for the configs and tolerances: the CPU parity suite and the checkpoint helpers.
parity_suite = _load("_cuda_zero_parity", os.path.join(TESTS, "zero", "test_zero_parity.py"))
ckpt = _load("_cuda_checkpoint_runs", os.path.join(TESTS, "checkpoint", "checkpoint_runs.py"))

STEPS, MICRO, LR, CLIP = parity_suite.STEPS, parity_suite.MICRO, parity_suite.LR, parity_suite.CLIP
TOLERANCE = (
    parity_suite.TOLERANCE
)  # {precision: (max abs param error, error / movement, relative loss error)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The environment of a device-side process: no ZENGINE_DEVICE (tests/conftest.py sets "cpu" for the
# CPU suite), so the engine's own rule picks the device: NCCL -> cuda:LOCAL_RANK, gloo -> cpu.
DEVICE_ENV = {"ZENGINE_DEVICE": None}


# -- processes ---------------------------------------------------------------------------------
def spawn_backend(
    fn, world_size: int, backend: str, *args, env: dict | None = None, timeout: float = 900.0
) -> list:
    """``harness.spawn`` on ``backend`` (nccl: rank r on cuda:r), with a device-side default timeout."""
    return spawn(fn, world_size, *args, timeout=timeout, backend=backend, env=env)


# -- small helpers -----------------------------------------------------------------------------
def expected_device(device: str) -> torch.device:
    """``"cuda"`` -> this process's current CUDA device (cuda:0 at world size 1); else as given."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def plain_gpu_numerics(device: str) -> None:
    """On CUDA: fp32 matmuls in full fp32 (no TF32) and 16-bit matmuls accumulated in fp32, so that the
    comparison with the reference measures the engine, not the GEMM settings."""
    if torch.device(device).type != "cuda":
        return
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def on_device(batches, device: torch.device):
    return [(x.to(device), y.to(device)) for x, y in batches]


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _guard(fn, *args) -> dict:
    """Run one case as ``fn(*args, errors)``; an exception becomes a failure of that case, kept with the
    failures it had found before (the other cases still run)."""
    start = time.perf_counter()
    errors: list = []
    try:
        out = fn(*args, errors)
    except Exception:
        out = {"errors": errors + [f"raised:\n{traceback.format_exc()}"]}
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def wrong_device(engine, device: torch.device, errors: list) -> bool:
    """True (and a failure recorded) when the engine does not compute on ``device``: the case stops there,
    as its inputs are made on ``device``."""
    if engine.device == device:
        return False
    errors.append(f"engine.device is {engine.device}, expected {device}: the case stops here")
    return True


def case_id(case) -> str:
    """A readable test id: ``s2-bf16-cpu-gas2``, ``s3-fp16-none-inf``, ``init-bf16-param`` ..."""
    parts = []
    for v in case:
        if isinstance(v, bool):
            if v:
                parts.append("allused")
        elif isinstance(v, int):
            parts.append(f"gas{v}" if parts else f"s{v}")
        else:
            parts.append(str(v))
    return "-".join(parts)


OFFLOADS = {
    "none": False,
    "cpu": True,
    "nvme": "nvme",
    "param": "param",
    "param+nvme": "param+nvme",
}


def engine_config(
    stage: int, precision: str, gas: int, offload: str, nvme_dir: str, world: int = 1
) -> dict:
    """test_zero_parity's config (gradient clipping on, small buckets, stage 3 sharding everything), with
    the NVMe swap directory under ``nvme_dir``."""
    cfg = parity_suite.engine_config(stage, precision, gas, world, OFFLOADS[offload])
    off = cfg["zero_optimization"].get("offload_optimizer")
    if off is not None and off.get("device") == "nvme":
        off["nvme_path"] = os.path.join(nvme_dir, "zswap")
    return cfg


def _where(offload: str, device: torch.device) -> tuple[torch.device, torch.device]:
    """(where the fp32 masters and optimizer states live, where stage-3 parameter shards live)."""
    host = torch.device("cpu")
    master = device if offload == "none" else host
    shard = host if offload.startswith("param") else device
    return master, shard


def check_placement(engine, device: torch.device, offload: str, errors: list, when: str) -> None:
    """The engine computes on ``device``; its module's parameters are there; masters, optimizer states,
    gradient stores and stage-3 shards are where the offload setting puts them."""
    if engine.device != device:
        errors.append(f"{when}: engine.device is {engine.device}, expected {device}")
    bad = sorted(
        {f"{n}@{p.device}" for n, p in engine.module.named_parameters() if p.device != device}
    )
    if bad:
        errors.append(f"{when}: module parameters off {device}: {bad[:6]}")
    opt = engine.optimizer
    master_dev, shard_dev = _where(offload, device)
    for gi, m in enumerate(opt.masters):
        if m.device != master_dev:
            errors.append(f"{when}: fp32 master of group {gi} on {m.device}, expected {master_dev}")
    for gi, sp in enumerate(opt.shard_params):
        for k, t in opt.optimizer.state.get(sp, {}).items():
            if torch.is_tensor(t) and t.numel() > 1 and t.device != master_dev:
                errors.append(
                    f"{when}: optimizer state {k!r} of group {gi} on {t.device}, expected {master_dev}"
                )
    grads_dev = (
        device if offload == "none" else None
    )  # offloaded: stages 2-3 keep host shards, 0-1 device buffers
    for t in opt.grads.tensors():
        if grads_dev is not None and t.device != grads_dev:
            errors.append(
                f"{when}: a gradient buffer {tuple(t.shape)} on {t.device}, expected {grads_dev}"
            )
            break
    for g in opt.groups:
        flat = getattr(g, "shard_flat", None)
        if flat is not None and flat.device != shard_dev:
            errors.append(f"{when}: stage-3 parameter shard on {flat.device}, expected {shard_dev}")
    # stage 3 with the optimizer on a GPU: each param group cut into the gradient buckets
    # (zero/sub_groups.py), so that the gradient shards are made bucket by bucket
    if engine.zero_optimization_stage() == 3 and offload == "none" and device.type == "cuda":
        from zengine.zero.stage3.build import MAX_BUCKET_UNITS

        for pg in range(opt.group_map.count):
            members = opt.group_map.members(pg)
            buckets = [len(opt.grads.layout.queues[gi].buckets) for gi in members]
            if len(members) < MAX_BUCKET_UNITS and max(buckets) > 1:
                errors.append(f"{when}: param group {pg}'s groups hold {buckets} buckets, not one")


class ForwardWatch:
    """Forward pre-hooks (registered after the engine's, so they run after stage 3 gathered) that record
    any module parameter not on the device, or not whole, while its module runs."""

    def __init__(self, module, device: torch.device):
        self.device, self.bad, self.handles = device, set(), []
        for name, m in module.named_modules():
            if any(p is not None for p in m._parameters.values()):
                self.handles.append(m.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name):
        def check(m, args):
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                sp = lookup(p)
                whole = p.numel() == (sp.numel if sp is not None else p.numel())
                if p.device != self.device or not whole:
                    self.bad.add(f"{name}.{pname}@{p.device} numel {p.numel()}")

        return check

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def full_params(engine) -> dict:
    """Every parameter whole, in fp32, on the compute device."""
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def run_steps(
    engine, batches, gas: int, device: torch.device, errors: list, offload: str, watch=None
):
    """One optimizer step per batch (``gas`` micro-steps each); (mean losses, global norms)."""
    losses, norms, placement = [], [], []
    for s, batch in enumerate(batches):
        losses.append(train_global_batch(engine, batch, MICRO, gas, device))
        norms.append(engine.get_global_grad_norm())
        if not engine.was_step_applied():
            errors.append(f"step {s}: not applied (global norm {norms[-1]})")
        check_placement(engine, device, offload, placement, f"after step {s}")
    seen, unique = set(), []
    for e in placement:  # each placement problem once, at the first step it showed
        key = e.split(": ", 1)[-1]
        if key not in seen:
            seen.add(key)
            unique.append(e)
    errors += unique
    if watch is not None and watch.bad:
        errors.append(
            f"during forward: parameters not on {device} or not whole: {sorted(watch.bad)[:6]}"
        )
    return losses, norms


def compare_with_reference(
    what: str,
    params: dict,
    losses: list,
    norms: list,
    init,
    batches,
    precision: str,
    device: torch.device,
) -> tuple[list, dict]:
    """test_zero_parity's checks against ``reference_run`` on the same device; (failures, measurements)."""
    errors = []
    ref_norms = []
    ref_model = copy.deepcopy(init).to(device)
    ref_losses, ref_params = reference_run(ref_model, batches, LR, CLIP, norms=ref_norms)
    p_tol, move_tol, l_tol = TOLERANCE[precision]
    start = {n: p.detach() for n, p in ref_model.named_parameters()}
    moved = sum(((ref_params[n] - start[n]) ** 2).sum() for n in ref_params).sqrt().item()
    off = sum(((params[n] - ref_params[n]) ** 2).sum() for n in ref_params).sqrt().item()
    worst = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if moved <= 0.1:
        errors.append(f"{what}: the reference moved only {moved:.3g}: the check could not fail")
    if not off <= move_tol * moved:
        errors.append(
            f"{what}: parameters off by {off / moved:.3g} of the reference movement (tolerance {move_tol})"
        )
    if p_tol is not None and not worst <= p_tol:
        errors.append(f"{what}: max parameter error {worst:.3g} (tolerance {p_tol})")
    if len(losses) != len(ref_losses) or not loss_err <= l_tol:
        errors.append(
            f"{what}: losses {losses} vs reference {ref_losses} (relative tolerance {l_tol})"
        )
    if (
        precision == "fp32"
    ):  # the global norm over all shards, before clipping, as torch computes it
        bad = [
            (a, b) for a, b in zip(norms, ref_norms) if a is None or not abs(a - b) <= 1e-5 * abs(b)
        ]
        if bad or len(norms) != len(ref_norms):
            errors.append(f"{what}: global norms {norms} vs reference {ref_norms}")
    dtype = DTYPES[precision]
    init_state = {n: t.to(device) for n, t in init.state_dict().items()}
    for name in ("frozen.weight", "unused.weight", "unused.bias"):  # as torch DDP leaves them
        if not torch.equal(params[name], init_state[name].to(dtype).float()):
            errors.append(
                f"{what}: {name} changed; frozen and unused parameters must keep their initial values"
            )
    return errors, {
        "off_over_moved": off / max(moved, 1e-30),
        "max_param_error": worst,
        "max_loss_error": loss_err,
    }


# -- stage x precision x offload x accumulation ------------------------------------------------
def parity_case(case, device: str, nvme_dir: str, errors: list) -> dict:
    """case = (stage, precision, offload, gas, all_used). ``all_used`` freezes EdgeNet's unused layer so
    that every trained parameter gets a gradient: the offloaded step then writes the parameters in the
    same pass (CPUAdam's copy-out, uploaded through pinned staging on CUDA) instead of restoring the
    unused ones and copying the master back."""
    stage, precision, offload, gas, all_used = case
    dev = expected_device(device)
    reset_peak(dev)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    if all_used:
        model.unused.requires_grad_(False)
    init = copy.deepcopy(model)
    batches = on_device(make_batches(STEPS, MICRO * gas * world), dev)
    engine, *_ = zengine.initialize(
        model=model,
        config=engine_config(stage, precision, gas, offload, nvme_dir, world),
        model_parameters=edge_param_groups(model, LR),
    )
    if wrong_device(engine, dev, errors):
        return {"errors": errors}
    check_placement(engine, dev, offload, errors, "after initialize")
    if offload != "none":
        expected = (
            ("InfinityAdam" if stage == 3 else "SwappedAdam") if "nvme" in offload else "CPUAdam"
        )
        if type(engine.optimizer.optimizer).__name__ != expected:
            errors.append(
                f"the offloaded step runs {type(engine.optimizer.optimizer).__name__}, expected {expected}"
            )
    watch = ForwardWatch(engine.module, dev)
    losses, norms = run_steps(engine, batches, gas, dev, errors, offload, watch)
    watch.remove()
    params = full_params(engine)
    failures, measured = compare_with_reference(
        case_id(case), params, losses, norms, init, batches, precision, dev
    )
    memory = engine.memory_breakdown()  # runs over device tensors too
    return {
        "errors": errors + failures,
        "peak_bytes": peak_bytes(dev),
        "memory": memory,
        **measured,
    }


# -- fp16 overflow -----------------------------------------------------------------------------
HUGE_SCALE = 2.0**40  # loss * scale overflows fp16 in the logits' gradient


def _snapshot(engine) -> dict:
    """Parameters, masters and (in-memory) optimizer states, as host copies."""
    opt = engine.optimizer
    states = {}
    for gi, sp in enumerate(opt.shard_params):
        for k, t in opt.optimizer.state.get(sp, {}).items():
            if torch.is_tensor(t):
                states[f"{gi}.{k}"] = t.detach().cpu().clone()
    return {
        "params": {n: t.cpu() for n, t in full_params(engine).items()},
        "masters": [m.detach().cpu().clone() for m in opt.masters],
        "states": states,
    }


def _differences(a: dict, b: dict) -> list:
    out = [f"param {n}" for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
    out += [
        f"master {i}"
        for i, (x, y) in enumerate(zip(a["masters"], b["masters"]))
        if not torch.equal(x, y)
    ]
    out += [
        f"state {k}"
        for k in a["states"]
        if k not in b["states"] or not torch.equal(a["states"][k], b["states"][k])
    ]
    return out


def overflow_case(case, device: str, nvme_dir: str, errors: list) -> dict:
    """case = (stage, offload, how): how = "inf" (an Inf injected into fc1.weight's gradient) or "scale"
    (the loss scale raised to 2**40 for one step). fp16 with hysteresis 1: the first overflow halves."""
    stage, offload, how = case
    dev = expected_device(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = EdgeNet()
    cfg = engine_config(stage, "fp16", 1, offload, nvme_dir, world)
    cfg["fp16"]["hysteresis"] = 1
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    batches = on_device(make_batches(3, MICRO * world), dev)
    if wrong_device(engine, dev, errors):
        return {"errors": errors}

    def step(batch):
        x, y = micro_batch(batch, rank, world, MICRO, 0)
        engine.backward(engine(x, y))
        engine.step()

    step(batches[0])
    if not engine.was_step_applied():
        errors.append(f"the first step (scale {engine.loss_scale:g}) was skipped")
    scale0 = engine.loss_scale
    before = _snapshot(engine)
    handle = None
    if how == "scale":
        engine.scaler.scale = HUGE_SCALE
        expected_scale = HUGE_SCALE / 2
    else:
        handle = engine.module.fc1.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        expected_scale = scale0 / 2
    step(batches[1])
    if handle is not None:
        handle.remove()
    if engine.was_step_applied():
        errors.append("the overflowing step was applied (was_step_applied() True)")
    if engine.skipped_steps != 1:
        errors.append(f"skipped_steps {engine.skipped_steps}, expected 1")
    if engine.loss_scale != expected_scale:
        errors.append(
            f"loss scale {engine.loss_scale:g} after the overflow, expected {expected_scale:g} (halved)"
        )
    changed = _differences(before, _snapshot(engine))
    if changed:
        errors.append(f"the skipped step changed {changed[:6]}")
    check_placement(engine, dev, offload, errors, "after the skipped step")

    engine.scaler.scale = scale0 if how == "scale" else engine.scaler.scale  # a sane scale again
    step(batches[2])
    if not engine.was_step_applied():
        errors.append(
            f"the step after the overflow was skipped too (scale {engine.loss_scale:g}): the "
            f"non-finite gradient was not cleared"
        )
    after = _snapshot(engine)
    if not _differences(before, after):
        errors.append("the step after the overflow changed nothing")
    if not all(torch.isfinite(t).all() for t in after["params"].values()):
        errors.append("non-finite parameters after the step that followed the overflow")
    return {"errors": errors, "scale_before": scale0, "scale_after": engine.loss_scale}


# -- zero.Init and GatheredParameters ----------------------------------------------------------
INIT_STEPS = 5


def _true_shape(p) -> tuple:
    sp = lookup(p)
    return sp.shape if sp is not None else tuple(p.shape)


def init_param_groups(model, lr: float) -> list[dict]:
    """``edge_param_groups`` for a model built inside zero.Init, whose parameters show empty tensors:
    matrices and vectors told apart by their real shapes."""
    decay = [p for p in model.parameters() if p.requires_grad and len(_true_shape(p)) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and len(_true_shape(p)) < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2},
    ]


def _master_slice(engine, sp):
    for gi, g in enumerate(engine.optimizer.groups):
        for k, other in enumerate(g.sharded):
            if other is sp:
                off = g.offsets[k]
                return engine.optimizer.masters[gi][off : off + sp.valid]
    return None


def init_case(case, device: str, nvme_dir: str, errors: list) -> dict:
    """case = (precision, offload): stage 3, a model built inside zero.Init."""
    precision, offload = case
    dev = expected_device(device)
    reset_peak(dev)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    with zengine.zero.Init():
        model = EdgeNet()
    torch.manual_seed(0)
    plain = EdgeNet()  # the same draws: Init must not change the initial values
    for n, p in model.named_parameters():
        sp = lookup(p)
        if sp is None:
            errors.append(f"built in Init: {n} is not sharded")
        elif (
            sp.state is not ParamState.SHARDED
            or sp.shard.device != dev
            or p.device != dev
            or p.numel() != 0
        ):
            errors.append(
                f"built in Init: {n} state {sp.state.value}, shard on {sp.shard.device}, parameter "
                f"{p.device} numel {p.numel()}; expected sharded with the shard on {dev}"
            )
    params = list(model.parameters())
    with zengine.zero.GatheredParameters(params):
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            if p.device != dev or not torch.equal(p.detach().cpu(), q.detach()):
                errors.append(
                    f"built in Init: {n} gathered on {p.device} differs from a plain build"
                )
    # modifier_rank=0 before the engine: the write lands in this rank's shard
    with zengine.zero.GatheredParameters([model.fc1.weight], modifier_rank=0):
        with torch.no_grad():
            model.fc1.weight.mul_(0.5)
    with torch.no_grad():
        plain.fc1.weight.mul_(0.5)
    sp = lookup(model.fc1.weight)
    want = plain.fc1.weight.detach().reshape(-1)[rank * sp.chunk : rank * sp.chunk + sp.valid]
    if not torch.equal(sp.shard[: sp.valid].cpu(), want) or sp.state is not ParamState.SHARDED:
        errors.append(
            "GatheredParameters(modifier_rank=0) before the engine: the write is not in the shard "
            "(or the parameter stayed gathered)"
        )

    init = copy.deepcopy(plain)
    batches = on_device(make_batches(INIT_STEPS, MICRO * world), dev)
    cfg = engine_config(3, precision, 1, offload, nvme_dir, world)
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=init_param_groups(model, LR)
    )
    if wrong_device(engine, dev, errors):
        return {"errors": errors}
    check_placement(engine, dev, offload, errors, "after initialize")
    watch = ForwardWatch(engine.module, dev)
    losses, norms = run_steps(engine, batches, 1, dev, errors, offload, watch)
    watch.remove()
    opt = engine.optimizer  # with stage3_param_persistence_threshold 0 nothing should stay gathered
    persistent = sorted(s.name for s in opt.all_sharded if s.persistent)
    gathered = sorted(s.name for s in opt.all_sharded if s.state is ParamState.GATHERED)
    if (
        persistent or gathered
    ):  # Init-built parameters show empty tensors: judged by their real size
        errors.append(
            f"stage3_param_persistence_threshold 0: persistent {persistent}, still gathered after the "
            f"steps {gathered}; expected none (the model would stay whole on every GPU)"
        )
    failures, measured = compare_with_reference(
        f"init-{precision}-{offload}",
        full_params(engine),
        losses,
        norms,
        init,
        batches,
        precision,
        dev,
    )
    errors += failures

    # modifier_rank=0 inside the engine: the write lands in the shard and in the fp32 master
    bias = engine.module.fc2.bias
    with zengine.zero.GatheredParameters([bias], modifier_rank=0):
        with torch.no_grad():
            bias.fill_(0.25)
    sp = lookup(bias)
    _, shard_dev = _where(offload, dev)
    if sp.shard.device != shard_dev or not bool((sp.shard[: sp.valid] == 0.25).all()):
        errors.append(
            f"GatheredParameters(modifier_rank=0) in the engine: shard on {sp.shard.device} "
            f"(expected {shard_dev}) holds {sp.shard[: sp.valid].tolist()[:4]}..., expected 0.25"
        )
    master = _master_slice(engine, sp)
    if master is None or not bool((master == 0.25).all()):
        errors.append(
            "GatheredParameters(modifier_rank=0) in the engine: the fp32 master does not hold the write"
        )
    if not bool((full_params(engine)["fc2.bias"] == 0.25).all()):
        errors.append(
            "GatheredParameters(modifier_rank=0) in the engine: summon_full_params does not show the write"
        )
    x, y = micro_batch(
        on_device(make_batches(1, MICRO * world, seed=99), dev)[0], rank, world, MICRO, 0
    )
    engine.backward(engine(x, y))
    engine.step()
    after = full_params(engine)["fc2.bias"]
    if (
        not engine.was_step_applied()
        or bool((after == 0.25).all())
        or not bool(torch.isfinite(after).all())
    ):
        errors.append(
            "the step after GatheredParameters(modifier_rank=0) did not train from the written values"
        )
    check_placement(engine, dev, offload, errors, "after the last step")
    return {
        "errors": errors,
        "peak_bytes": peak_bytes(dev),
        "persistent": persistent,
        "gathered_after_step": gathered,
        "parameters": len(opt.all_sharded),
        **measured,
    }


# -- one process, many cases -------------------------------------------------------------------
# -- peak device memory against the ZeRO formulas ----------------------------------------------
MEM_LAYERS, MEM_WIDTH = 12, 2048  # 50M parameters, 201 MB in fp32: the states dominate the peak


def memory_case(case, device: str, nvme_dir: str, errors: list) -> dict:
    """case = (stage, "plain" | "init"): 12 x Linear(2048) fp32 AdamW at world size 1, 3 steps; the peak of
    ``torch.cuda.max_memory_allocated`` over build, initialize, forward, backward and step in units of
    the fp32 model (None on the CPU), the model states counted after the steps, and zengine.estimate's
    peak. Stage 3 with the least-memory settings (one layer gathered, no prefetch, no overlap)."""
    from torch import nn

    from zengine.estimate import estimate

    stage, how = case
    with_init = how == "init"
    dev = expected_device(device)
    unit = 4 * MEM_LAYERS * MEM_WIDTH * MEM_WIDTH
    bucket = MEM_WIDTH * MEM_WIDTH  # one layer
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero.update(
            stage3_max_live_parameters=bucket,
            stage3_max_reuse_distance=0,
            stage3_prefetch_bucket_size=0,
            overlap_comm=False,
            stage3_param_persistence_threshold=0,
        )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }

    def build():
        return nn.Sequential(
            *[nn.Linear(MEM_WIDTH, MEM_WIDTH, bias=False) for _ in range(MEM_LAYERS)]
        )

    predicted = estimate(build(), config, dist.get_world_size()).peak_device / unit
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
    reset_peak(dev)
    torch.manual_seed(0)
    if with_init:
        with zengine.zero.Init():
            model = build()
    else:
        model = build().to(dev)
    engine, *_ = zengine.initialize(model=model, config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, MEM_WIDTH, device=dev)).pow(2).mean())
        engine.step()
    peak = peak_bytes(dev)
    counted = model_state_bytes(engine.memory_breakdown()) / unit
    engine.destroy()
    return {
        "errors": errors,
        "peak": None if peak is None else (peak - base) / unit,
        "counted": counted,
        "estimate": predicted,
    }


def run_groups(plan: dict, device: str, tmp: str) -> dict:
    """Run every case of ``plan`` ({"parity": [...], "overflow": [...], "init": [...], "memory": [...]}) in
    this process.

    Returns {group: {case id: result}} plus "process": what this process computed on."""
    plain_gpu_numerics(device)
    dev = expected_device(device)
    runners = {
        "parity": parity_case,
        "overflow": overflow_case,
        "init": init_case,
        "memory": memory_case,
    }
    out = {}
    for group, cases in plan.items():
        out[group] = {case_id(c): _guard(runners[group], c, device, tmp) for c in cases}
    from zengine.distributed.process_group import ProcessRank

    out["process"] = {
        "backend": dist.get_backend(),
        "placement": str(ProcessRank.current().device),
        "device": str(dev),
        "peak_bytes": peak_bytes(dev),
        "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }
    return out


# -- checkpoints across devices ----------------------------------------------------------------
CKPT_STEPS, CKPT_STOP = 5, 2
_CKPT_OFFLOAD = {"none": False, "cpu": "cpu"}


def ckpt_id(case) -> str:
    """case = (stage, precision, offload of the saving side, offload of the loading side)."""
    stage, precision, save, load = case
    return f"s{stage}-{precision}-save_{save}-load_{load}"


def _ckpt_train(engine, batches, device: torch.device) -> list:
    """checkpoint_runs.train with the batches on the compute device."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = ckpt.GLOBAL_BATCH // world
    losses = []
    for batch in batches:
        x, y = micro_batch(batch, rank, world, micro, 0)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _ckpt_params(engine) -> dict:
    return ckpt.as_lists(ckpt.full_params(engine))


def _each_ckpt_case(cases, device: str, what: str, offload_of, run) -> dict:
    """Per case id: ``run(case, cfg, data, dev, errors) -> (losses, params)`` on the case's config (with the
    offload ``offload_of(case)`` names) and batches; an exception becomes that case's error."""
    dev = expected_device(device)
    out = {}
    for case in cases:
        stage, precision = case[:2]
        errors = []
        try:
            cfg = ckpt.config(stage, precision, _CKPT_OFFLOAD[offload_of(case)])
            data = on_device(ckpt.batches(CKPT_STEPS), dev)
            losses, params = run(case, cfg, data, dev, errors)
            out[ckpt_id(case)] = {"losses": losses, "params": params, "errors": errors}
        except Exception:
            out[ckpt_id(case)] = {"errors": errors + [f"{what} raised:\n{traceback.format_exc()}"]}
    return out


def ckpt_save(root: str, cases, device: str) -> dict:
    """Per case: the losses of an uninterrupted run, and a second run saved after CKPT_STOP steps
    (with its parameters at that point)."""

    def run(case, cfg, data, dev, errors):
        whole = ckpt.make_engine(cfg, seed=0)
        if whole.device != dev:
            errors.append(f"saving run: engine.device {whole.device}, expected {dev}")
        losses = _ckpt_train(whole, data, dev)
        first = ckpt.make_engine(cfg, seed=0)
        _ckpt_train(first, data[:CKPT_STOP], dev)
        params = _ckpt_params(first)
        first.save_checkpoint(os.path.join(root, ckpt_id(case)))
        return losses, params

    return _each_ckpt_case(cases, device, "saving", lambda case: case[2], run)


def ckpt_load(root: str, cases, device: str) -> dict:
    """Per case: a fresh engine (other initial weights) loads the checkpoint saved under ``root`` and
    trains the remaining steps; its parameters right after loading, and its losses."""

    def run(case, cfg, data, dev, errors):
        engine = ckpt.make_engine(cfg, seed=1)
        engine.load_checkpoint(os.path.join(root, ckpt_id(case)))
        if engine.device != dev:
            errors.append(f"loading run: engine.device {engine.device}, expected {dev}")
        if engine.global_steps != CKPT_STOP:
            errors.append(f"loading run: global_steps {engine.global_steps}, expected {CKPT_STOP}")
        params = _ckpt_params(engine)
        bad = sorted({str(p.device) for p in engine.module.parameters() if p.device != dev})
        if bad:
            errors.append(f"loading run: parameters on {bad} after load_checkpoint, expected {dev}")
        return _ckpt_train(engine, data[CKPT_STOP:], dev), params

    return _each_ckpt_case(cases, device, "loading", lambda case: case[3], run)


def device_side(dev_root: str, cpu_root: str, cases, device: str) -> dict:
    """The device process: save its own checkpoints, and load the CPU ranks' ones."""
    plain_gpu_numerics(device)
    return {
        "saved": ckpt_save(dev_root, cases, device),
        "loaded": ckpt_load(cpu_root, cases, device),
    }


CPU_WORLD = 2


def checkpoint_sequence(root: str, cases, device: str, on_cpu, on_device) -> dict:
    """CPU ranks save; the device process saves and loads the CPU checkpoints; CPU ranks load the device
    checkpoints. ``on_cpu(fn, *args)`` / ``on_device(fn, *args)`` run ``fn`` on that side and return rank
    0's result. Returns every side's results by case id."""
    cpu_root, dev_root = os.path.join(root, "cpu"), os.path.join(root, "device")
    cpu_saved = on_cpu(ckpt_save, cpu_root, cases, "cpu")
    dev = on_device(device_side, dev_root, cpu_root, cases, device)
    cpu_loaded = on_cpu(ckpt_load, dev_root, cases, "cpu")
    return {
        "cpu_saved": cpu_saved,
        "dev_saved": dev["saved"],
        "dev_loaded": dev["loaded"],
        "cpu_loaded": cpu_loaded,
    }


def checkpoint_roundtrip(
    root: str, cases, device: str, backend: str, timeout: float = 900.0
) -> dict:
    """``checkpoint_sequence`` across processes: two gloo CPU ranks, and one ``backend`` process on
    ``device`` (NCCL on cuda:0 on a GPU machine)."""
    return checkpoint_sequence(
        root,
        cases,
        device,
        on_cpu=lambda fn, *args: spawn(fn, CPU_WORLD, *args)[0],
        on_device=lambda fn, *args: spawn_backend(
            fn, 1, backend, *args, env=DEVICE_ENV, timeout=timeout
        )[0],
    )


def checkpoint_in_this_process(root: str, cases, device: str) -> dict:
    """``checkpoint_sequence`` with every side in this process (the CPU smoke test: one process is quick)."""

    def here(fn, *args):
        return fn(*args)

    return checkpoint_sequence(root, cases, device, here, here)


def placement_probe() -> dict:
    """The placement checks can fail: a CPU engine (stage 3, optimizer offloaded) checked against the
    right expectations, and against another device, with and without offload (on the CPU itself host
    and device are one, so the offload expectations are told apart on the stand-in device "meta")."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=engine_config(3, "bf16", 1, "cpu", "", world),
        model_parameters=edge_param_groups(model, LR),
    )
    cpu, other = torch.device("cpu"), torch.device("meta")
    right, wrong_dev, wrong_offload = [], [], []
    watch_right, watch_wrong = ForwardWatch(engine.module, cpu), ForwardWatch(engine.module, other)
    x, y = micro_batch(make_batches(1, MICRO * world)[0], rank, world, MICRO, 0)
    engine.backward(engine(x, y))
    engine.step()
    check_placement(engine, cpu, "cpu", right, "probe")
    check_placement(engine, other, "cpu", wrong_dev, "probe")
    check_placement(
        engine, other, "none", wrong_offload, "probe"
    )  # masters, states, grads, shards all on "meta"
    return {
        "right": right + sorted(watch_right.bad),
        "wrong_device": wrong_dev,
        "watch_wrong": sorted(watch_wrong.bad),
        "wrong_offload": wrong_offload,
        "stops": wrong_device(engine, other, []),
    }


def cpu_smoke(plan: dict, tmp: str, ckpt_cases) -> dict:
    """The CPU smoke test's one process: ``run_groups`` on the CPU, the placement probe and the checkpoint
    sequence."""
    return {
        "groups": run_groups(plan, "cpu", tmp),
        "probe": placement_probe(),
        "checkpoint": checkpoint_in_this_process(os.path.join(tmp, "ckpt"), ckpt_cases, "cpu"),
    }


def checkpoint_failures(results: dict, case, direction: str) -> list:
    """direction "device-to-cpu": saved by the device process, continued by CPU ranks; "cpu-to-device":
    the other way. The parameters right after loading equal the saved ones exactly; the continued losses
    match the saving side's uninterrupted run (fp32: 1e-5 relative; 16-bit: the parity tolerance)."""
    cid = ckpt_id(case)
    saved, loaded = (
        (results["dev_saved"], results["cpu_loaded"])
        if direction == "device-to-cpu"
        else (results["cpu_saved"], results["dev_loaded"])
    )
    saved, loaded = saved[cid], loaded[cid]
    errors = [f"saving side: {e}" for e in saved["errors"]] + [
        f"loading side: {e}" for e in loaded["errors"]
    ]
    if "losses" not in saved or "losses" not in loaded:
        return errors
    differ = sorted(n for n in saved["params"] if saved["params"][n] != loaded["params"].get(n))
    if differ:
        errors.append(f"parameters right after loading differ from those saved: {differ}")
    tol = 1e-5 if case[1] == "fp32" else TOLERANCE[case[1]][2]
    expected = saved["losses"][CKPT_STOP:]
    if len(loaded["losses"]) != len(expected) or any(
        abs(a - b) > tol * abs(b) for a, b in zip(loaded["losses"], expected)
    ):
        errors.append(
            f"continued losses {loaded['losses']} vs uninterrupted {expected} (relative tolerance {tol})"
        )
    return errors


# -- the CPU suite stays on the CPU --------------------------------------------------------------
def stays_on_cpu() -> dict:
    """A gloo rank of the CPU suite, on any machine: placement and engine on the CPU, with and without
    ZENGINE_DEVICE=cpu (tests/conftest.py sets it; the backend alone must already mean the CPU), and no
    CUDA context made by training (a pinned buffer or a stray .cuda() would make one)."""
    from zengine.distributed.process_group import ProcessRank

    out = {"cuda_initialized_before": torch.cuda.is_initialized()}
    previous = os.environ.pop("ZENGINE_DEVICE", None)
    try:
        out["placement_default"] = str(ProcessRank.current().device)
        os.environ["ZENGINE_DEVICE"] = "cpu"
        out["placement_env_cpu"] = str(ProcessRank.current().device)
        os.environ.pop("ZENGINE_DEVICE")
        rank, world = dist.get_rank(), dist.get_world_size()
        devices = {}
        for stage, offload in (
            (2, "cpu"),
            (3, "param"),
        ):  # pin_memory asked for: must not pin without a GPU
            torch.manual_seed(0)
            model = EdgeNet()
            engine, *_ = zengine.initialize(
                model=model,
                config=engine_config(stage, "bf16", 1, offload, "", world),
                model_parameters=edge_param_groups(model, LR),
            )
            for batch in make_batches(2, MICRO * world):
                x, y = micro_batch(batch, rank, world, MICRO, 0)
                engine.backward(engine(x, y))
                engine.step()
            errors = []
            check_placement(
                engine, torch.device("cpu"), offload, errors, f"stage {stage} offload {offload}"
            )
            devices[f"s{stage}-{offload}"] = {"engine": str(engine.device), "errors": errors}
        out["engines"] = devices
    finally:
        if previous is not None:
            os.environ["ZENGINE_DEVICE"] = previous
    out["cuda_initialized_after"] = torch.cuda.is_initialized()
    return out
