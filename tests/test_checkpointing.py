"""Activation checkpointing (``zengine.checkpointing``, DeepSpeed's ``deepspeed.checkpointing``)."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zengine
from configs import NO_PREFETCH, SHARD_ALL, ds_config
from harness import spawn
from zengine import checkpointing
from zengine.activation import SAVED_ON_HOST, current as current_settings, restore_defaults
from zengine.config import ConfigError, load_config

DIM, HIDDEN = 12, 20


@pytest.fixture(autouse=True)
def fresh_settings():
    """Each test starts as a fresh process would: default settings, not configured, no counts."""
    restore_defaults()
    SAVED_ON_HOST.reset_counts()
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    restore_defaults()
    checkpointing.get_cuda_rng_tracker().reset()


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0, tracked_dropout: float = 0.0):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.dropout, self.tracked_dropout = dropout, tracked_dropout

    def forward(self, x):
        h = F.dropout(torch.tanh(self.up(x)), self.dropout, self.training)
        if (
            self.tracked_dropout
        ):  # dropout drawn from the tracker's stream, as tensor-parallel layers do
            with checkpointing.get_cuda_rng_tracker().fork():
                h = F.dropout(h, self.tracked_dropout, self.training)
        return x + self.down(h)


class Stack(nn.Module):
    """Segments (a block, after a read of ``mix.weight`` outside ``mix``) that go through
    ``checkpointing.checkpoint`` when ``use_checkpoint`` is set."""

    def __init__(self, n: int = 3, **block):
        super().__init__()
        self.mix = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(**block) for _ in range(n))
        self.norm = nn.LayerNorm(DIM)
        self.use_checkpoint = False

    def segment(self, block, x):
        # At stage 3 the recomputation must gather mix.weight itself: its module is not running.
        return block(x + 0.1 * F.linear(x, self.mix.weight))

    def forward(self, x):
        x = self.mix(x)
        for block in self.blocks:
            x = (
                checkpointing.checkpoint(self.segment, block, x)
                if self.use_checkpoint
                else self.segment(block, x)
            )
        return self.norm(x).pow(2).mean()


def gradients(model: Stack, x: torch.Tensor, use_checkpoint: bool, seed: int = 5):
    """(loss, input gradient, parameter gradients) of one forward/backward from a fixed RNG state."""
    model.zero_grad()
    model.use_checkpoint = use_checkpoint
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    if model.blocks[0].tracked_dropout:
        checkpointing.get_cuda_rng_tracker().reset()
        checkpointing.get_cuda_rng_tracker().add("model-parallel-rng", 99)
    loss = model(x)
    loss.backward()
    return loss.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def assert_same_gradients(model, x):
    loss, x_grad, grads = gradients(model, x, use_checkpoint=False)
    loss_c, x_grad_c, grads_c = gradients(model, x, use_checkpoint=True)
    assert torch.equal(loss, loss_c)
    assert torch.equal(x_grad, x_grad_c)  # the same ops in the same order: the same bits on the CPU
    for g, g_c in zip(grads, grads_c):
        assert torch.equal(g, g_c)


@pytest.mark.parametrize(
    "block",
    [{}, {"dropout": 0.3}, {"dropout": 0.2, "tracked_dropout": 0.4}],
    ids=["plain", "dropout", "tracker-dropout"],
)
def test_gradients_equal_those_without_checkpointing(block):
    torch.manual_seed(0)
    assert_same_gradients(Stack(**block), torch.randn(6, DIM))


def test_cpu_checkpointing_keeps_the_inputs_in_cpu_memory():
    checkpointing.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(0)
    model, x = Stack(n=3, dropout=0.1), torch.randn(6, DIM)
    copies = SAVED_ON_HOST
    model.use_checkpoint = True
    loss = model(x.requires_grad_(True))
    # one saved input per checkpointed block went through the host hooks, kept in CPU memory,
    # and nothing else (what the blocks save inside is recomputed, not stored)
    assert copies.packed == 3 and copies.unpacked == 0
    assert [d.type for d in copies.host_devices] == ["cpu"] * 3
    assert copies.moved_bytes == 0  # already on the CPU: kept, not copied a second time
    loss.backward()
    assert copies.unpacked == 3  # each recomputation took its input back
    SAVED_ON_HOST.reset_counts()
    assert_same_gradients(model, x.detach())
    assert copies.packed == 3


def test_without_cpu_checkpointing_nothing_goes_through_the_host_hooks():
    model = Stack()
    gradients(model, torch.randn(4, DIM), use_checkpoint=True)
    assert SAVED_ON_HOST.packed == 0


def test_return_values_shaped_as_deepspeed_shapes_them():
    x = torch.randn(3, requires_grad=True)
    assert torch.equal(checkpointing.checkpoint(lambda t: t * 2, x), x * 2)
    one = checkpointing.checkpoint(lambda t: (t * 2,), x)
    assert torch.is_tensor(one) and torch.equal(one, x * 2)
    a, b = checkpointing.checkpoint(lambda t, k: [t * k, t + k], x, 3.0)
    assert torch.equal(a, x * 3) and torch.equal(b, x + 3)
    out = checkpointing.checkpoint(lambda t: {"y": t.sin()}, x)
    out["y"].sum().backward()
    assert torch.allclose(x.grad, x.detach().cos())
    assert checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint


def test_no_input_requires_grad_and_no_grad_mode():
    layer = nn.Linear(DIM, DIM)
    y = checkpointing.checkpoint(layer, torch.randn(2, DIM))  # only the parameters need gradients
    y.sum().backward()
    assert layer.weight.grad is not None
    with torch.no_grad():
        assert not checkpointing.checkpoint(layer, torch.randn(2, DIM)).requires_grad


def test_configure_refuses_an_mpu_by_name():
    class MPU:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(ValueError, match=r"mpu_=MPU.*no model parallelism.*mpu_=None"):
        checkpointing.configure(MPU())
    assert not checkpointing.is_configured()


def test_configure_arguments_and_their_checks():
    checkpointing.configure(
        None,
        partition_activations=True,
        contiguous_checkpointing=True,
        num_checkpoints=4,
        checkpoint_in_cpu=True,
        synchronize=True,
        profile=True,
    )
    settings = current_settings()
    assert (
        settings.partition_activations,
        settings.contiguous_memory_optimization,
        settings.number_checkpoints,
        settings.cpu_checkpointing,
        settings.synchronize_checkpoint_boundary,
        settings.profile,
    ) == (True, True, 4, True, True, True)
    with pytest.raises(ValueError, match="contiguous_checkpointing.*needs partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="contiguous_checkpointing.*needs num_checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(
        ValueError, match=r"checkpoint_in_cpu: .*boolean.*\n.*num_checkpoints: .*greater"
    ):
        checkpointing.configure(None, checkpoint_in_cpu="yes", num_checkpoints=0)


def test_configure_from_a_deepspeed_config_file_dict_or_loaded_config(tmp_path):
    section = {"cpu_checkpointing": True, "profile": True, "number_checkpoints": 8}
    config = {"train_batch_size": 8, "activation_checkpointing": section}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for source in (str(path), path, config, load_config(config, world_size=2)):
        restore_defaults()
        checkpointing.configure(None, deepspeed_config=source)
        assert current_settings().cpu_checkpointing and current_settings().profile
        assert current_settings().number_checkpoints == 8
    # an argument overrides the file
    checkpointing.configure(None, deepspeed_config=config, checkpoint_in_cpu=False)
    assert not current_settings().cpu_checkpointing and current_settings().profile
    # a file without the section: the defaults
    checkpointing.configure(None, deepspeed_config={"train_batch_size": 8})
    assert not current_settings().cpu_checkpointing
    with pytest.raises(
        ConfigError,
        match="activation_checkpointing.cpu_checkpoint: unknown key; did you mean "
        "'cpu_checkpointing'",
    ):
        checkpointing.configure(
            None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}}
        )


def test_config_section_parsed_and_checked():
    cfg = load_config(
        {
            "train_batch_size": 4,
            "activation_checkpointing": {
                "partition_activations": True,
                "cpu_checkpointing": True,
                "contiguous_memory_optimization": False,
                "number_checkpoints": 12,
                "synchronize_checkpoint_boundary": True,
                "profile": False,
            },
        },
        world_size=2,
    )
    section = cfg.activation_checkpointing
    assert (
        section.cpu_checkpointing
        and section.partition_activations
        and section.synchronize_checkpoint_boundary
    )
    assert section.number_checkpoints == 12 and not section.profile
    assert "activation_checkpointing" not in cfg.ignored_keys
    default = load_config({"train_batch_size": 4, "activation_checkpointing": None}, world_size=2)
    assert default.activation_checkpointing == type(section)()
    with pytest.raises(ConfigError) as error:
        load_config(
            {
                "train_batch_size": 4,
                "activation_checkpointing": {
                    "cpu_checkpoint": True,
                    "number_checkpoints": 0,
                    "profile": 1,
                },
            },
            world_size=2,
        )
    message = str(error.value)
    assert (
        "activation_checkpointing.cpu_checkpoint: unknown key; did you mean 'cpu_checkpointing'?"
        in message
    )
    assert "activation_checkpointing.number_checkpoints:" in message
    assert "activation_checkpointing.profile:" in message


def test_is_configured_reset_and_the_engine_section():
    assert not checkpointing.is_configured()
    section = load_config(
        {"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": True}},
        world_size=1,
    ).activation_checkpointing
    checkpointing.configure_from_config(section)  # what the engine does at initialize
    assert current_settings().cpu_checkpointing and not checkpointing.is_configured()
    checkpointing.configure(None, profile=True)  # the script's own call starts from the defaults
    assert checkpointing.is_configured()
    assert current_settings().profile and not current_settings().cpu_checkpointing
    checkpointing.configure_from_config(
        section
    )  # a later initialize keeps what the script configured
    assert current_settings().profile and not current_settings().cpu_checkpointing
    checkpointing.reset()  # DeepSpeed's reset frees buffers; the settings stay
    assert checkpointing.is_configured() and current_settings().profile


def test_profile_logs_forward_and_recompute_times():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    zlog = logging.getLogger("zengine")
    zlog.addHandler(handler)
    level = zlog.level
    zlog.setLevel(logging.INFO)
    try:
        checkpointing.configure(None, profile=True, synchronize=True)
        gradients(Stack(n=2), torch.randn(3, DIM), use_checkpoint=True)
    finally:
        zlog.removeHandler(handler)
        zlog.setLevel(level)
    lines = [r.getMessage() for r in records if "activation checkpoint " in r.getMessage()]
    phases = [line.split(": ")[1].split()[0] for line in lines]
    assert sorted(phases) == ["forward", "forward", "recompute", "recompute"], lines
    assert all(line.endswith(" ms") for line in lines)


def test_rng_tracker_and_model_parallel_seed():
    tracker = checkpointing.get_cuda_rng_tracker()
    checkpointing.model_parallel_cuda_manual_seed(1234)
    default_draws = torch.rand(4)
    checkpointing.model_parallel_cuda_manual_seed(1234)
    with tracker.fork():
        tracked = torch.rand(4)
    assert torch.equal(torch.rand(4), default_draws)  # the fork left the default stream untouched
    with tracker.fork():
        tracked_next = torch.rand(4)  # the tracked stream continues where it stopped
    torch.manual_seed(1234 + 2718)
    assert torch.equal(tracked, torch.rand(4)) and torch.equal(tracked_next, torch.rand(4))
    with pytest.raises(ValueError, match="seed 3952"):
        tracker.add("other", 1234 + 2718)
    with pytest.raises(KeyError, match="no stream named 'missing'"):
        with tracker.fork("missing"):
            pass
    states = tracker.get_states()
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.set_states(states)
    assert set(tracker.get_states()) == {"model-parallel-rng"}


# -- through zengine.initialize, 2 ranks ------------------------------------------------------------
def engine_config(stage: int, cpu_checkpointing: bool = False) -> dict:
    # stage 3: every parameter sharded and released after each use: recomputation must gather
    zero = {**SHARD_ALL, **NO_PREFETCH} if stage == 3 else {}
    return ds_config(
        stage,
        micro_batch=4,
        zero=zero,
        activation_checkpointing={"cpu_checkpointing": cpu_checkpointing},
    )


def train_run(stage: int, mode: str) -> list:
    """3 steps of a Stack whose blocks are checkpointed ("checkpoint", "cpu") or not ("plain");
    returns the whole parameters after them, as lists."""
    restore_defaults()
    torch.manual_seed(0)
    model = Stack(n=3, dropout=0.1)
    model.use_checkpoint = mode != "plain"
    config = engine_config(stage, cpu_checkpointing=mode == "cpu")
    if mode == "cpu":
        checkpointing.configure(None, deepspeed_config=config)  # as DeepSpeed scripts do
    engine, *_ = zengine.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(7 + rank)  # dropout: the same masks in every mode
    SAVED_ON_HOST.reset_counts()
    for _ in range(3):
        engine.backward(engine(torch.randn(4, DIM, generator=g)))
        engine.step()
    if mode == "cpu":
        assert SAVED_ON_HOST.packed == 9 and SAVED_ON_HOST.unpacked == 9
    with engine.summon_full_params(writeback=False):
        params = [p.detach().clone().tolist() for p in engine.module.parameters()]
    engine.destroy()
    return params


def same_training_with_and_without_checkpointing(stage: int) -> bool:
    reference = train_run(stage, "plain")
    for mode in ("checkpoint", "cpu"):
        for ref, got in zip(reference, train_run(stage, mode)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=1e-6)
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_training_through_initialize_matches_without_checkpointing(stage):
    assert spawn(same_training_with_and_without_checkpointing, 2, stage) == [True, True]


def section_after_initialize() -> tuple:
    restore_defaults()
    engine, *_ = zengine.initialize(
        model=Stack(), config={**engine_config(2, cpu_checkpointing=True)}
    )
    engine.destroy()
    return current_settings().cpu_checkpointing, checkpointing.is_configured()


def test_initialize_applies_the_config_section():
    assert spawn(section_after_initialize, 1) == [(True, False)]
