"""``zengine.initialize``: build an Engine from a model and a DeepSpeed-style config."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any, Iterable, Optional

import torch
from torch import nn

from .config import ZengineConfig, load_config
from .distributed.process_group import DEFAULT_PORT, ProcessRank, init_distributed
from .engine.build import Training
from .engine.engine import Engine


def _config_source(config, config_params, args) -> Any:
    given = [c for c in (config, config_params) if c is not None]
    from_args = None
    if args is not None:
        for attr in ("zengine_config", "deepspeed_config"):
            if getattr(args, attr, None):
                from_args = getattr(args, attr)
                break
    if len(given) > 1:
        raise ValueError(
            "zengine.initialize: pass the config once, as config= or config_params=, not both"
        )
    if given and from_args is not None:
        raise ValueError(
            f"zengine.initialize: a config was passed both in the call and in args "
            f"({from_args!r}); keep one"
        )
    source = given[0] if given else from_args
    if source is None:
        raise ValueError(
            "zengine.initialize: no config; pass config= (a path or a dict) or set "
            "--deepspeed_config/--zengine_config in args"
        )
    return source


def comm_timeout(cfg: ZengineConfig) -> timedelta:
    """The collectives' timeout: the launcher's ``--comm_timeout`` (``ZENGINE_COMM_TIMEOUT``) when given,
    else the config's ``comm_timeout``."""
    raw = os.environ.get("ZENGINE_COMM_TIMEOUT")
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(
                f"ZENGINE_COMM_TIMEOUT={raw!r}: expected a number of seconds"
            ) from None
        if seconds <= 0:
            raise ValueError(f"ZENGINE_COMM_TIMEOUT={raw!r}: must be positive")
        return timedelta(seconds=seconds)
    return timedelta(seconds=cfg.comm_timeout)


def _apply_timeout_to_existing_group(cfg: ZengineConfig) -> None:
    """The script started the process group itself: its timeout stands unless the config or the
    launcher asks for one (``comm_timeout`` set explicitly, or ``--comm_timeout``)."""
    if "comm_timeout" not in cfg.model_fields_set and not os.environ.get("ZENGINE_COMM_TIMEOUT"):
        return
    try:
        torch.distributed.distributed_c10d._set_pg_timeout(comm_timeout(cfg))
    except Exception as err:  # an old torch or a backend without it: say so, keep going
        warnings.warn(
            f"zengine: could not apply comm_timeout to the existing process group ({err}); "
            "pass timeout= to init_process_group instead"
        )


def _refuse_unimplemented(cfg: ZengineConfig, trains: bool) -> None:
    """Valid DeepSpeed settings whose feature zengine does not have yet: refused before any work.
    ``trains``: the engine has an optimizer (without one, parameter offload stands alone)."""
    from .config import ConfigError

    zero = cfg.zero_optimization
    problems = []
    if (
        trains
        and zero.offload_param is not None
        and zero.offload_param.enabled
        and not zero.offload_optimizer.enabled
    ):
        problems.append(
            f"zero_optimization.offload_param.device: parameter offload to "
            f"{zero.offload_param.device!r} needs the optimizer on the host too; add offload_optimizer "
            f"{{device: cpu}} (or nvme)"
        )
    if problems:
        raise ConfigError(
            "zengine config asks for features this version lacks:\n" + "\n".join(problems)
        )


def _refuse_untrainable(model: nn.Module) -> None:
    """A model with nothing to train, given an optimizer, is a mistake (everything frozen, or built
    empty): say so before any work. (DeepSpeed 0.19.8 fails there too at stages 1-3, with an
    IndexError or a bare assertion, and at stage 0 builds an optimizer that changes nothing.) An engine
    without an optimizer trains nothing by design and is not checked."""
    params = list(model.parameters())
    if not params:
        raise ValueError(
            f"zengine.initialize: the model ({type(model).__name__}) has no parameters; there is "
            "nothing to train. Pass the model after its layers are built"
        )
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"zengine.initialize: none of the model's {len(params)} parameters requires grad (all "
            "frozen); unfreeze the ones to train (p.requires_grad_(True)) before initialize"
        )


def initialize(
    args: Any = None,
    model: Optional[nn.Module] = None,
    optimizer: Any = None,
    model_parameters: Optional[Iterable] = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn=None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    **unsupported: Any,
):
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    Without an optimizer (no ``optimizer=``, no ``"optimizer"`` section) the engine runs forward only
    (a reference model, inference): sharded and saved as the config says, ``backward`` and ``step``
    refused by name; the optimizer and scheduler returned are None.

    DeepSpeed's parameters in DeepSpeed's order (see docs/API.md for each); call it with keywords.
    ``initialize(model, config)``, with the model first, is also taken as meant. The config is
    validated before any work starts; the process group is initialised when it is not yet (on
    ``distributed_port`` when the launcher set no port). ``mpu`` and ``mesh_param`` (model/tensor
    parallelism) are refused when given.
    """
    if isinstance(args, nn.Module) and not isinstance(model, nn.Module):
        # zengine's first form, initialize(model, config): the second positional is the config
        args, model, config = None, args, config if model is None else model
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "zengine.initialize: mpu/mesh_param describe model (tensor/pipeline) parallelism, which "
            "zengine does not have; it is data parallel only (ZeRO). Leave them None"
        )
    if unsupported:
        raise TypeError(
            f"zengine.initialize: unsupported argument(s) {sorted(unsupported)} "
            "(zengine has no model/pipeline parallelism)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"zengine.initialize: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    source = _config_source(config, config_params, args)
    local_rank = getattr(args, "local_rank", None) if args is not None else None
    if local_rank is not None and local_rank >= 0 and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank)
    # Validate before any work, the process group included: the world size is known from the launcher.
    world = (
        torch.distributed.get_world_size()
        if torch.distributed.is_initialized()
        else int(
            os.environ.get(
                "WORLD_SIZE",
                os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")),
            )
        )
    )
    cfg = load_config(source, world)
    trains = Training.of(optimizer, cfg).has_optimizer  # else an engine for forward only
    if trains:
        _refuse_untrainable(model)
    _refuse_unimplemented(cfg, trains)
    if torch.distributed.is_initialized():
        _apply_timeout_to_existing_group(cfg)
    elif dist_init_required is not False:
        init_distributed(distributed_port=distributed_port, timeout=comm_timeout(cfg))
    process_rank = ProcessRank.current()
    if (
        process_rank.device.type == "cuda"
    ):  # torch.cuda.current_device() (get_accelerator()) is ours
        torch.cuda.set_device(process_rank.device)
    engine = Engine(
        model,
        cfg,
        process_rank,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    # without an optimizer there is none to give the script (DeepSpeed's stage 0 gives None too)
    optimizer = engine.optimizer if engine.trains.has_optimizer else None
    return engine, optimizer, engine.training_dataloader, engine.lr_scheduler
