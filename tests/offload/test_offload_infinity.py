"""ZeRO-Infinity (stage 3, parameters and optimizer on NVMe): what the swap files do besides the numbers
(parity is in test_zero_parity.py): reads ahead from a bounded pool, zero.Init straight to the file, a
file that vanishes or a disk that fills gives an error naming the path and loses no checkpoint, and
nothing is left on disk however the process ends."""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import zengine
from configs import SHARD_ALL, ds_config, nvme
from harness import free_port, spawn
from models import EdgeNet, make_batches, train_global_batch

MICRO = 2


def infinity_config(directory: str, buffer_count: int = 4, max_in_cpu: int = 0) -> dict:
    return ds_config(
        3,
        micro_batch=MICRO,
        steps_per_print=1000,
        zero={
            "reduce_bucket_size": 300,
            "sub_group_size": 1000,
            **SHARD_ALL,
            "stage3_prefetch_bucket_size": 1500,
            "stage3_max_live_parameters": 4000,
        },
        offload_param=nvme(
            directory, buffer_count=buffer_count, buffer_size=4096, max_in_cpu=max_in_cpu
        ),
        offload_optimizer=nvme(directory, buffer_count=2),
    )


def _leftovers(directory: str) -> list[str]:
    return (
        sorted(f for f in os.listdir(directory) if f.startswith("zengine-"))
        if os.path.isdir(directory)
        else []
    )


def reads_ahead(directory: str) -> dict:
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(
        model=EdgeNet(), config=infinity_config(directory, buffer_count=6)
    )
    swap = engine.optimizer.param_swap
    hits = []
    for batch in make_batches(3, MICRO * dist.get_world_size()):
        before = (swap.prefetch_hits, swap.demand_reads)
        train_global_batch(engine, batch, MICRO, 1)
        hits.append((swap.prefetch_hits - before[0], swap.demand_reads - before[1]))
    out = {
        "hits": hits,
        "pool": len(swap.slots),
        "extra": swap.extra_buffers,
        "files_while_running": _leftovers(directory),
    }
    engine.destroy()
    return out


def test_reads_follow_the_trace_ahead_of_use_from_a_bounded_pool(tmp_path):
    for r in spawn(reads_ahead, 2, str(tmp_path)):
        first, *later = r["hits"]
        assert (
            first[0] == 0 and first[1] > 0
        )  # the first step records the trace: every read on demand
        for hits, demand in later:  # then the reads run ahead along it
            assert hits > demand, r["hits"]
        assert r["pool"] == 6 and r["extra"] == 0  # never more than buffer_count read buffers
        assert (
            r["files_while_running"] == []
        )  # the swap files are unlinked as soon as they are open


def init_to_nvme(directory: str) -> dict:
    cfg = infinity_config(directory)
    torch.manual_seed(0)
    with zengine.zero.Init(config_dict_or_path=cfg):
        model = EdgeNet()
    from zengine.zero.stage3.param import lookup

    sharded = [lookup(p) for p in model.parameters()]
    in_file = all(
        sp is not None and sp.shard is None and sp.swap_file is not None for sp in sharded
    )
    with zengine.zero.GatheredParameters(
        model.fc1.bias, modifier_rank=0
    ):  # written back to the file
        if dist.get_rank() == 0:
            model.fc1.bias.data.fill_(0.25)
    engine, *_ = zengine.initialize(model=model, config=cfg)
    with engine.summon_full_params(writeback=False):
        bias = model.fc1.bias.detach().clone()
    for batch in make_batches(2, MICRO * dist.get_world_size()):
        train_global_batch(engine, batch, MICRO, 1)
    with engine.summon_full_params(writeback=False):
        params = {n: p.detach().tolist() for n, p in model.named_parameters()}
    engine.destroy()
    return {"in_file": in_file, "bias": bias.tolist(), "params": params}


def built_in_memory(directory: str) -> dict:
    torch.manual_seed(0)
    model = EdgeNet()
    with torch.no_grad():
        model.fc1.bias.fill_(0.25)
    engine, *_ = zengine.initialize(model=model, config=infinity_config(directory))
    for batch in make_batches(2, MICRO * dist.get_world_size()):
        train_global_batch(engine, batch, MICRO, 1)
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().tolist() for n, p in model.named_parameters()}


def test_zero_init_writes_shards_to_nvme_as_modules_are_built(tmp_path):
    results = spawn(init_to_nvme, 3, str(tmp_path))
    expected = spawn(built_in_memory, 3, str(tmp_path))[0]
    for r in results:
        assert r[
            "in_file"
        ]  # every shard went to the file as its module was built, none kept in memory
        assert r["bias"] == [0.25] * len(r["bias"])  # GatheredParameters wrote it back
        for name, value in expected.items():  # and trains exactly as the same model built in memory
            assert r["params"][name] == value, name
    assert _leftovers(str(tmp_path)) == []


def modify_while_training(directory: str, offload: bool) -> dict:
    """GatheredParameters(modifier_rank=0) between steps: the change reaches the shards (on NVMe) and the
    fp32 masters (swapped with the moments), so the next steps train from it."""
    torch.manual_seed(0)
    cfg = infinity_config(directory)
    if not offload:
        del cfg["zero_optimization"]["offload_param"], cfg["zero_optimization"]["offload_optimizer"]
    engine, *_ = zengine.initialize(model=EdgeNet(), config=cfg)
    batches = make_batches(4, MICRO * dist.get_world_size())
    for batch in batches[:2]:
        train_global_batch(engine, batch, MICRO, 1)
    with zengine.zero.GatheredParameters(engine.module.fc2.weight, modifier_rank=0):
        if dist.get_rank() == 0:
            engine.module.fc2.weight.data.mul_(0.5)
    losses = [train_global_batch(engine, batch, MICRO, 1) for batch in batches[2:]]
    with engine.summon_full_params(writeback=False):
        return {
            "losses": losses,
            "params": {n: p.detach().tolist() for n, p in engine.module.named_parameters()},
        }


def test_gathered_parameters_modified_between_steps_reach_the_swapped_masters(tmp_path):
    swapped = spawn(modify_while_training, 3, str(tmp_path), True)[0]
    plain = spawn(modify_while_training, 3, str(tmp_path), False)[0]
    assert swapped["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    worst = max(
        (torch.tensor(swapped["params"][n]) - torch.tensor(v)).abs().max().item()
        for n, v in plain["params"].items()
    )
    assert worst <= 1e-5


def vanishing_file(directory: str, ckpt: str, which: str) -> dict:
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=EdgeNet(), config=infinity_config(directory))
    batches = make_batches(3, MICRO)
    for batch in batches[:2]:
        train_global_batch(engine, batch, MICRO, 1)
    engine.save_checkpoint(ckpt, tag="good")
    with engine.summon_full_params(writeback=False):
        saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    swap = engine.optimizer.param_swap if which == "params" else engine.optimizer.optimizer.swapper
    os.ftruncate(swap.file.fd, 0)  # the drive lost the file's contents under us
    try:
        train_global_batch(engine, batches[2], MICRO, 1)
        error = None
    except OSError as e:
        error = str(e)
    torch.manual_seed(1)
    fresh, *_ = zengine.initialize(model=EdgeNet(), config=infinity_config(directory))
    fresh.load_checkpoint(ckpt, tag="good")
    with fresh.summon_full_params(writeback=False):
        loaded = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    return {
        "error": error,
        "path": swap.file.path,
        "same": all(torch.equal(saved[n], loaded[n]) for n in saved),
        "step": fresh.global_steps,
    }


@pytest.mark.parametrize("which", ["params", "optimizer"])
def test_a_vanished_swap_file_fails_naming_it_and_loses_no_checkpoint(tmp_path, which):
    r = spawn(vanishing_file, 1, str(tmp_path / "swap"), str(tmp_path / "ckpt"), which)[0]
    assert r["error"] is not None and r["path"] in r["error"], r["error"]
    assert r["same"] and r["step"] == 2  # the checkpoint before the failure loads whole


def full_disk(directory: str, with_init: bool) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(
        signal.SIGXFSZ, signal.SIG_IGN
    )  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # the "disk" holds one page
    try:
        cfg = infinity_config(directory)
        if with_init:
            with zengine.zero.Init(config_dict_or_path=cfg):
                EdgeNet()
        else:
            zengine.initialize(model=EdgeNet(), config=cfg)
    except OSError as e:
        return str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    return "no error"


@pytest.mark.parametrize("with_init", [False, True])
def test_a_full_disk_is_refused_before_training_naming_the_path(tmp_path, with_init):
    message = spawn(full_disk, 1, str(tmp_path), with_init)[0]
    assert str(tmp_path) in message and ("free space" in message), message


KILLED = textwrap.dedent("""
    import sys, time, torch
    sys.path[:0] = {tests!r}
    import zengine
    from models import EdgeNet, make_batches, train_global_batch
    from test_offload_infinity import infinity_config
    cfg = infinity_config({directory!r})
    with zengine.zero.Init(config_dict_or_path=cfg):
        model = EdgeNet()
    engine, *_ = zengine.initialize(model=model, config=cfg)
    train_global_batch(engine, make_batches(1, 2)[0], 2, 1)
    print("trained", flush=True)
    time.sleep(600)
""")


def test_nothing_is_left_on_disk_after_kill_9(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)]),
    )
    script = KILLED.format(tests=[tests, os.path.dirname(tests)], directory=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "trained", proc.stderr.read()
        fd_dir = f"/proc/{proc.pid}/fd"
        held = [os.readlink(os.path.join(fd_dir, f)) for f in os.listdir(fd_dir)]
        swapped = [h for h in held if str(tmp_path) in h]
        assert swapped and all(h.endswith("(deleted)") for h in swapped), (
            held
        )  # open, yet already unlinked
        assert _leftovers(str(tmp_path)) == []
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs
        proc.wait(timeout=30)
    time.sleep(0.1)
    assert _leftovers(str(tmp_path)) == []
    assert os.listdir(tmp_path) == []
