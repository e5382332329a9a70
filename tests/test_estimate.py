"""zengine.estimate: the ZeRO formulas per stage, precision and offload, and the step's transients."""

import subprocess
import sys

import pytest
from torch import nn

from configs import ds_config
from zengine.estimate import all_choices, estimate, main

PSI = 8_000_000


def _cfg(stage, **zero):
    return ds_config(stage, micro_batch=1, lr=None, zero=zero)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_model_states_follow_the_zero_formulas(world):
    per = {
        0: 16 * PSI,
        1: 8 * PSI + 8 * PSI / world,
        2: 4 * PSI + 12 * PSI / world,
        3: 16 * PSI / world,
    }
    for stage, expected in per.items():
        est = estimate(PSI, _cfg(stage), world)
        assert est.device_states == pytest.approx(expected, rel=1e-6), (stage, est.format())
        assert est.host_states == 0
    # bf16: 2 bytes of parameter, 4 of fp32 gradient shard (accumulated in fp32 at stages 2-3), 4 of fp32
    # master, 8 of moments; a bf16 gradient shard (DeepSpeed's default) is 2
    bf16 = {**_cfg(2), "bf16": {"enabled": True}}
    assert estimate(PSI, bf16, world).device_states == pytest.approx(
        2 * PSI + 16 * PSI / world, rel=1e-6
    )
    bf16["data_types"] = {"grad_accum_dtype": "bf16"}
    assert estimate(PSI, bf16, world).device_states == pytest.approx(
        2 * PSI + 14 * PSI / world, rel=1e-6
    )


def test_offload_moves_states_to_the_host():
    world = 4
    cpu = estimate(PSI, _cfg(2, offload_optimizer={"device": "cpu"}), world)
    assert cpu.device == {"parameters": 4 * PSI}
    # fp32 gradient shard, master, moments, and the staging CPUAdam writes the parameters into (fp32 here)
    assert cpu.host_states == 20 * PSI // world
    both = estimate(
        PSI, _cfg(3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"}), world
    )
    assert both.device_states == 0 and both.host_states == 20 * PSI // world
    nvme_cfg = {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 4}
    nvme = estimate(PSI, _cfg(2, offload_optimizer=nvme_cfg, sub_group_size=250_000), world)
    assert nvme.host["optimizer swap buffers"] == 4 * 2 * 4 * 250_000  # buffers, not the moments
    few = estimate(PSI, _cfg(2, offload_optimizer=nvme_cfg, sub_group_size=1_000_000), world)
    assert few.host["optimizer swap buffers"] == 2 * 2 * 4 * 1_000_000  # two chunks: two buffers
    # training on the CPU: CPU offload moves nothing (the host is the device), NVMe only the moments
    assert (
        estimate(
            PSI, _cfg(2, offload_optimizer={"device": "cpu"}), world, cpu_training=True
        ).device_states
        == estimate(PSI, _cfg(2), world).device_states
    )


def test_partial_offload_splits_the_states_by_deepspeeds_sub_groups():
    world, sub = 4, 300_000  # a shard of 2M elements: 7 sub-groups (6 of 300k and one of 200k)
    shard = PSI // world

    def partial(ratio, model=PSI):
        section = {"device": "cpu", "ratio": ratio}
        return estimate(model, _cfg(3, offload_optimizer=section, sub_group_size=sub), world)

    whole = estimate(PSI, _cfg(3, offload_optimizer={"device": "cpu"}), world)
    assert partial(1.0).host == whole.host and partial(1.0).device == whole.device
    # ratio 0.5: the first int(0.5 x 7) = 3 sub-groups stay on the device (fp32: master = parameters)
    half = partial(0.5)
    on_device = 3 * sub
    assert half.device["optimizer states"] == 8 * on_device
    assert half.device["gradients"] == 4 * on_device
    assert half.host["optimizer states"] == 8 * (shard - on_device)
    assert half.host["copy staging"] == 4 * (shard - on_device)
    # ratio 0: nothing on the host, the device holds what it holds without offload
    none = partial(0.0)
    assert none.host_states == 0 and not any(none.host.values())
    assert none.device_states == estimate(PSI, _cfg(3), world).device_states
    # bf16: the device share's shards are kept in fp32 and are its masters (placement.shard_dtype),
    # the host share's are bf16 beside host masters
    low = estimate(
        PSI,
        ds_config(
            3,
            "bf16",
            micro_batch=1,
            lr=None,
            zero={"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "sub_group_size": sub},
        ),
        world,
    )
    assert low.device["parameters"] == 4 * on_device + 2 * (shard - on_device), low.device
    assert "master weights" not in low.device and low.host["master weights"] == 4 * (
        shard - on_device
    )
    # with the parameters' sizes, whole parameters make the sub-groups (zero/sub_groups.py)
    # (shards of 300k and 100k: [p0] [p1] [p2] [p3] [p4-p6] [p7-p9] [p10 p11], the first 3 on the device)
    by_param = partial(0.5, [1_200_000] * 4 + [400_000] * 8)
    assert by_param.device["optimizer states"] == 8 * 3 * 300_000
    assert by_param.device["optimizer states"] + by_param.host["optimizer states"] == 8 * shard


def test_transients_are_bounded_by_their_keys():
    model = nn.Sequential(
        nn.Linear(1000, 1000, bias=False), nn.Linear(1000, 10, bias=False), nn.LayerNorm(10)
    )
    numel = sum(p.numel() for p in model.parameters())
    est = estimate(model, _cfg(2, reduce_bucket_size=100_000, overlap_comm=False), 2)
    assert est.transients == {
        "autograd gradient": 4 * 1_000_000,
        "gradient buckets": 4 * 100_000 * 1,
    }
    est3 = estimate(
        model,
        _cfg(
            3,
            reduce_bucket_size=100_000,
            stage3_max_live_parameters=300_000,
            stage3_prefetch_bucket_size=50_000,
        ),
        2,
    )
    assert est3.transients["gathered parameters"] == 4 * min(
        300_000 + 1_000_000, numel
    )  # live limit + module in hand
    assert (
        "prefetch staging" not in est3.transients
    )  # one sharded parameter per module: gathered in place
    with_bias = estimate(
        nn.Linear(1000, 1000),
        _cfg(3, stage3_param_persistence_threshold=100, stage3_prefetch_bucket_size=50_000),
        2,
    )
    assert (
        with_bias.transients["prefetch staging"] == 4 * 50_000
    )  # weight and bias share a staging buffer
    assert est3.device["persistent parameters"] == 4 * (10_000 + 20) // 2  # small ones kept whole
    assert est3.device["parameters"] == 4 * -(-numel // 2)
    # optimizer offload on a GPU: reduced buckets kept while their copies down run, at most 1 GiB, at most the gradient
    off = {"device": "cpu"}
    small = estimate(model, _cfg(2, offload_optimizer=off), 2)
    assert small.transients["gradient downloads"] == 4 * numel
    assert (
        estimate(10**9, _cfg(3, offload_optimizer=off), 4).transients["gradient downloads"]
        == 1 << 30
    )
    assert (
        "gradient downloads"
        not in estimate(model, _cfg(2, offload_optimizer=off), 2, cpu_training=True).transients
    )
    assert "gradient downloads" not in estimate(model, _cfg(2), 2).transients


def test_every_choice_and_the_command_line(capsys):
    choices = all_choices(PSI, 8)
    assert [(e.stage, e.label) for e in choices][:3] == [
        (0, "fp32"),
        (1, "fp32"),
        (1, "fp32, optimizer on cpu"),
    ]
    assert len(choices) == 8
    assert main(["--params", "8e6", "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("ZeRO stage") == 8 and "optimizer on cpu, parameters on cpu" in out
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "zengine.estimate",
            "--params",
            "1.3e9",
            "--gpus",
            "8",
            "--config",
            "configs/zero3.json",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "ZeRO stage 3, 8 rank(s)" in done.stdout, done.stderr


@pytest.mark.parametrize(
    "bf16,per_param",
    [
        ({}, 16),  # 2 parameter + 2 gradient + 4 master + 8 moments (stage 1, one rank)
        ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, 8),
        (
            {
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
                "master_rounding": "kahan",
            },
            10,
        ),
        ({"bf16_master_weights_and_grads": True}, 12),  # fp32 moments over bf16 masters
    ],
)
def test_bf16_masters_bytes_per_parameter(bf16, per_param):
    """bf16 masters are the bf16 parameters themselves; bf16 moments halve the states; Kahan's
    compensation adds 2 bytes. With CPU offload the masters are copies on the host."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True, **bf16},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    psi = 10**6
    assert estimate(psi, cfg, 1).device_states == per_param * psi
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    est = estimate(psi, cfg, 1)
    low = bool(bf16)
    assert est.host["master weights"] == (2 if low else 4) * psi * (
        2 if "master_rounding" in bf16 else 1
    )
    assert est.host["gradients"] == (2 if low else 4) * psi


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (2, True), (3, True)])
def test_fp16_masters_bytes_per_parameter(stage, offload):
    """fp16 masters (fp16.fp16_master_weights_and_grads) are the fp16 parameters themselves, with
    fp32 moments: 2 + 2 + 8 = 12 bytes per parameter on one rank against fp32 masters' 16; with
    CPU offload the masters and their gradients are 2-byte copies on the host."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    psi = 10**6
    est = estimate(psi, cfg, 1)
    assert "fp16 masters and gradients, fp32 moments" in est.label
    if offload:
        assert est.host["master weights"] == 2 * psi and est.host["gradients"] == 2 * psi
        assert est.host["optimizer states"] == 8 * psi
    else:
        assert est.device_states == 12 * psi


@pytest.mark.parametrize("stage,per_param", [(2, 8), (3, 12)])
def test_fp16_masters_swap_records(stage, per_param):
    """NVMe optimizer offload with fp16 masters: stage 2 swaps the fp32 moments (8 bytes per
    parameter), ZeRO-Infinity the record [exp_avg | exp_avg_sq | master | grad] = 4 + 4 + 2 + 2."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    psi = 10**6
    assert estimate(psi, cfg, 1).disk["optimizer swap file"] == per_param * psi
