"""Defaults equal DeepSpeed's; sizes accept DeepSpeed's spellings; every field is documented."""

import pytest
import torch
from pydantic import BaseModel, ValidationError

from zengine.config import (
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    AioConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZengineConfig,
    ZeroConfig,
)
from zengine.config.load import _known_paths


def test_defaults_equal_deepspeed():
    cfg = ZengineConfig()
    assert cfg.optimizer is None and cfg.scheduler is None
    assert (
        cfg.fp16.enabled,
        cfg.fp16.loss_scale,
        cfg.fp16.initial_scale_power,
        cfg.fp16.loss_scale_window,
        cfg.fp16.hysteresis,
        cfg.fp16.consecutive_hysteresis,
        cfg.fp16.min_loss_scale,
    ) == (False, 0, 16, 1000, 2, False, 1)
    assert cfg.bf16.enabled is False
    assert (cfg.gradient_clipping, cfg.steps_per_print, cfg.wall_clock_breakdown) == (
        0.0,
        10,
        False,
    )
    zero = cfg.zero_optimization
    assert zero.stage == 0
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.sub_group_size == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.stage3_debug_fetch_order is False
    opt = zero.offload_optimizer
    assert (opt.device, opt.nvme_path, opt.pin_memory, opt.buffer_count, opt.fast_init) == (
        "none",
        None,
        True,
        4,
        False,
    )  # pinned by default, as DeepSpeed since 0.19.5
    par = zero.offload_param
    assert (
        par.device,
        par.nvme_path,
        par.pin_memory,
        par.buffer_count,
        par.buffer_size,
        par.max_in_cpu,
    ) == ("none", None, True, 5, 100_000_000, 1_000_000_000)
    aio = cfg.aio
    assert (
        aio.block_size,
        aio.queue_depth,
        aio.thread_count,
        aio.single_submit,
        aio.overlap_events,
    ) == (1_048_576, 8, 1, False, True)


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_follows_deepspeed(stage, expected):
    assert ZeroConfig(stage=stage).overlap_comm is expected
    assert ZeroConfig(stage=stage, overlap_comm=not expected).overlap_comm is (not expected)


@pytest.mark.parametrize(
    "value", [500_000_000, 5e8, "5e8", "500_000_000", "500000000", " 5e8 ", "5.0e8"]
)
def test_sizes_accept_deepspeed_spellings(value):
    assert ZeroConfig(reduce_bucket_size=value).reduce_bucket_size == 500_000_000
    assert isinstance(ZeroConfig(reduce_bucket_size=value).reduce_bucket_size, int)


@pytest.mark.parametrize(
    "value", [-1, "-5e8", 1.5, "1.5", "5e-1", "abc", True, float("inf"), None, [1]]
)
def test_sizes_reject_non_whole_or_negative(value):
    with pytest.raises(ValidationError):
        ZeroConfig(reduce_bucket_size=value)


def test_zero_sizes_that_may_be_zero():
    zero = ZeroConfig(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size="0")
    assert zero.stage3_param_persistence_threshold == 0 and zero.stage3_prefetch_bucket_size == 0
    assert OffloadParamConfig(buffer_size="1e8", max_in_cpu=1e9).max_in_cpu == 1_000_000_000
    assert AioConfig(block_size="1_048_576").block_size == 1_048_576


@pytest.mark.parametrize("name", SUPPORTED_OPTIMIZERS)
def test_optimizer_types_case_insensitive(name):
    assert OptimizerConfig(type=name.lower()).type == name
    assert OptimizerConfig(type=name.upper()).params == {}


REQUIRED_SCHEDULER_PARAMS = {
    "WarmupDecayLR": {"total_num_steps": 100},
    "WarmupCosineLR": {"total_num_steps": 100},
    "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1},
}


@pytest.mark.parametrize("name", SUPPORTED_SCHEDULERS)
def test_scheduler_types_case_insensitive(name):
    params = REQUIRED_SCHEDULER_PARAMS.get(name)
    assert SchedulerConfig(type=name.lower(), params=params).type == name


def test_compute_dtype_and_offload_properties():
    assert ZengineConfig().compute_dtype == torch.float32
    assert ZengineConfig(bf16={"enabled": True}).compute_dtype == torch.bfloat16
    assert ZengineConfig(fp16={"enabled": True}).compute_dtype == torch.float16
    cfg = ZengineConfig(
        zero_optimization={
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        }
    )
    assert cfg.offload_param_enabled and cfg.offload_optimizer_enabled
    assert not ZengineConfig().offload_param_enabled
    assert ZengineConfig(fp16={"enabled": True}).fp16.dynamic_loss_scale
    assert ZengineConfig().fp16.initial_dynamic_scale == 65536.0


def test_assignment_is_validated():
    cfg = ZengineConfig()
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 4
    cfg.zero_optimization.reduce_bucket_size = "5e7"
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000


def _models(model):
    yield model
    for field in model.model_fields.values():
        for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from _models(sub)


def test_every_model_and_field_is_documented():
    for model in set(_models(ZengineConfig)):
        assert model.__doc__ and model.__doc__.strip(), model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"
    assert ("zero_optimization", "offload_param", "max_in_cpu") in set(_known_paths(ZengineConfig))
