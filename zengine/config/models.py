"""``ZengineConfig``: a whole zengine (DeepSpeed-compatible) JSON config, one typed section per key.

The sections are modelled by concern: ``base`` (the value types and the base
model every section shares: strict keys, strict types), ``precision`` (fp16,
bf16), ``zero`` (zero_optimization, its offload sections, aio), ``optimizer``
(optimizer, scheduler, nonfinite_gradients), ``monitor`` (tensorboard,
csv_monitor, wandb), ``activation_checkpointing`` and ``elastic`` (elasticity).
This module gathers them under the top-level keys and checks across sections.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from pydantic import Field, PrivateAttr, model_validator

from .activation_checkpointing import ActivationCheckpointingConfig
from .autocast import TorchAutocastConfig, autocast_problems, averaging_problems
from .base import BatchSize, Flag, Interval, Number, _Section
from .autotuning import AutotuningConfig
from .checkpoint import CheckpointConfig
from .compile import CompileConfig
from .elastic import ElasticityConfig
from .monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from .optimizer import NonFiniteGradientsConfig, OptimizerConfig, SchedulerConfig
from .shared_memory import SharedMemoryConfig
from .precision import (
    DTYPES,
    BF16Config,
    DataTypesConfig,
    DtypeName,
    FP16Config,
    master_precision_problem,
    precision_problem,
)
from .zero import AioConfig, ZeroConfig


class ZengineConfig(_Section):
    """A whole training config. Build it with ``load_config``, which also resolves the batch sizes."""

    DEPRECATED_KEYS: ClassVar[Dict[str, str]] = {"bfloat16": "bf16"}
    SECTIONS: ClassVar[Tuple[str, ...]] = (
        "fp16",
        "bf16",
        "torch_autocast",
        "data_types",
        "zero_optimization",
        "aio",
        "activation_checkpointing",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "elasticity",
        "compile",
        "checkpoint",
        "shared_memory",
        "autotuning",
    )

    train_batch_size: BatchSize = Field(
        None,
        description="Samples per optimizer step over all data-parallel "
        "ranks: micro batch * accumulation steps * world size.",
    )
    train_micro_batch_size_per_gpu: BatchSize = Field(
        None, description="Samples per forward/backward on one rank."
    )
    gradient_accumulation_steps: BatchSize = Field(
        None, description="Micro batches accumulated per optimizer step."
    )
    optimizer: Optional[OptimizerConfig] = Field(
        None, description="Optimizer to build; None when the script passes its own."
    )
    scheduler: Optional[SchedulerConfig] = Field(
        None, description="LR scheduler to build; None for a constant LR or one the script passes."
    )
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 mixed precision.")
    torch_autocast: TorchAutocastConfig = Field(
        default_factory=TorchAutocastConfig,
        description="fp32 parameters and masters, the forward under torch.autocast.",
    )
    communication_data_type: Optional[DtypeName] = Field(
        None,
        description=(
            "The dtype gradients are summed in across ranks (all-reduce, reduce-scatter): fp32, fp16 or bf16. "
            "Default (null): the compute dtype, as DeepSpeed and FSDP2 do. fp32 with bf16/fp16 compute rounds "
            "once instead of at each rank's addition and cannot overflow fp16, at twice the bucket bytes."
        ),
    )
    fp32_allreduce: Flag = Field(
        False,
        description=(
            "DeepSpeed's older spelling of communication_data_type fp32 (half-precision gradients "
            "reduced in fp32); true with communication_data_type unset means fp32."
        ),
    )
    prescale_gradients: Flag = Field(
        False,
        description=(
            "Divide each gradient by the data-parallel world size before the reduction, not after "
            "(the sum cannot overflow fp16; it rounds differently)."
        ),
    )
    gradient_predivide_factor: Number = Field(
        1.0,
        gt=0,
        description=(
            "Divide each gradient by this before the reduction and by world size / factor after "
            "(DeepSpeed's split of the mean, keeping fp16 sums in range)."
        ),
    )
    data_types: DataTypesConfig = Field(
        default_factory=DataTypesConfig,
        description=("grad_accum_dtype: the dtype gradients are summed in across micro-steps."),
    )
    gradient_clipping: Number = Field(
        0.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping."
    )
    steps_per_print: Interval = Field(
        10,
        description="Log progress every this many optimizer steps "
        "(float('inf'), as accelerate sets it: never).",
    )
    auto_resume: Optional[str] = Field(
        None,
        description=(
            "zengine only: a save_dir of engine.save_checkpoint; initialize loads its latest checkpoint when "
            "there is one (a restarted or resubmitted job continues where it was), and starts fresh when not."
        ),
    )
    comm_timeout: Number = Field(
        300.0,
        gt=0,
        description=(
            "zengine only: seconds a collective operation of the process group may wait for the other ranks "
            "before it fails, so a rank that died or diverged ends the run with an error instead of a hang."
        ),
    )
    shared_memory: SharedMemoryConfig = Field(
        default_factory=SharedMemoryConfig,
        description=(
            "zengine only: collectives of CPU (gloo) ranks on one host through shared memory."
        ),
    )
    nonfinite_gradients: NonFiniteGradientsConfig = Field(
        default_factory=NonFiniteGradientsConfig,
        description=(
            "zengine only: skip, count and report steps whose gradient is NaN/Inf; stop after too many in a row."
        ),
    )
    wall_clock_breakdown: Flag = Field(
        False,
        description="Time forward, backward and step; rank 0 logs the "
        "milliseconds every steps_per_print steps (and the "
        "monitors get them). Synchronizes a GPU at each "
        "timer start and stop.",
    )
    tensorboard: TensorBoardConfig = Field(
        default_factory=TensorBoardConfig, description="TensorBoard monitor."
    )
    csv_monitor: CSVMonitorConfig = Field(
        default_factory=CSVMonitorConfig, description="CSV file monitor."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases monitor.")
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig, description="ZeRO stage and its settings."
    )
    aio: AioConfig = Field(default_factory=AioConfig, description="Async I/O for NVMe offload.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="Settings of zengine.checkpointing (DeepSpeed's deepspeed.checkpointing), applied at "
        "initialize unless the script called checkpointing.configure itself.",
    )

    elasticity: ElasticityConfig = Field(
        default_factory=ElasticityConfig,
        description=(
            "Elastic batch sizes: when enabled, one global batch size usable at many world sizes, with the micro "
            "batch and accumulation steps derived at the run's world size."
        ),
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description=(
            "torch.compile of the model (DeepSpeed 0.14-0.16's enabled/backend/kwargs); engine.compile() does "
            "the same on demand."
        ),
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description=(
            "DeepSpeed's checkpoint options: tag_validation (ranks with different tags always fail)."
        ),
    )
    autotuning: AutotuningConfig = Field(
        default_factory=AutotuningConfig,
        description=(
            "DeepSpeed's autotuner keys (zengine --autotuning tune|run); in a trial, the profile steps."
        ),
    )

    _ignored_keys: Tuple[str, ...] = PrivateAttr(default=())
    _derived_batch_keys: Tuple[str, ...] = PrivateAttr(default=())
    _world_size: Optional[int] = PrivateAttr(default=None)
    _elastic_world_sizes: Tuple[int, ...] = PrivateAttr(default=())

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        problems = []
        data = {
            key: value for key, value in data.items() if not (key in cls.SECTIONS and value is None)
        }
        if "bfloat16" in data:
            legacy = data.pop("bfloat16")
            if "bf16" in data:
                problems.append("bfloat16: deprecated spelling of 'bf16'; give only one of them")
            else:
                warnings.warn("bfloat16 is deprecated; use bf16", DeprecationWarning, stacklevel=2)
                data["bf16"] = legacy
        if isinstance(data.get("zero_optimization"), bool):
            # DeepSpeed's oldest form: "zero_optimization": true meant stage 1.
            data["zero_optimization"] = {"stage": int(data["zero_optimization"])}
        return data, problems

    @model_validator(mode="after")
    def _one_precision(self) -> "ZengineConfig":
        problem = precision_problem(self.fp16, self.bf16) or master_precision_problem(
            self.fp16, self.bf16, self.zero_optimization.stage
        )
        if problem:
            raise ValueError(problem)
        problems = autocast_problems(self) + averaging_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        if self.fp32_allreduce:
            if self.communication_data_type not in (None, "fp32"):
                raise ValueError(
                    f"fp32_allreduce: true asks for fp32 reductions, communication_data_type says "
                    f"{self.communication_data_type!r}: give one of them"
                )
        wanted = self.data_types.param_dtype
        if wanted is not None and DTYPES[wanted] != self.compute_dtype:
            compute = next(name for name, dtype in DTYPES.items() if dtype == self.compute_dtype)
            raise ValueError(
                f"data_types.param_dtype: {wanted!r} differs from the compute dtype {compute!r} "
                f"(set by the fp16/bf16 sections); "
                f"DeepSpeed requires them to match: omit param_dtype or enable the matching section"
            )
        return self

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's ``engine.config`` is a dict; read as one (``config.get("zero_optimization", {}).get(
        "stage")``), a section comes back as a plain dict of its values, a top-level key as its value."""
        if key not in type(self).model_fields:
            return default
        value = getattr(self, key)
        return value.model_dump() if isinstance(value, _Section) else value

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return self.get(key)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of forward and backward: bfloat16, float16 or float32."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def offload_optimizer_enabled(self) -> bool:
        """True when optimizer states are offloaded to CPU or NVMe."""
        return self.zero_optimization.offload_optimizer.enabled

    @property
    def offload_param_enabled(self) -> bool:
        """True when stage-3 parameter shards are offloaded to CPU or NVMe."""
        return self.zero_optimization.offload_param.enabled

    @property
    def ignored_keys(self) -> Tuple[str, ...]:
        """DeepSpeed keys ``load_config`` accepted but zengine does not act on."""
        return self._ignored_keys

    @property
    def derived_batch_keys(self) -> Tuple[str, ...]:
        """Batch keys ``load_config`` computed from the others and the world size."""
        return self._derived_batch_keys

    @property
    def world_size(self) -> Optional[int]:
        """The data-parallel world size the batch sizes were resolved for."""
        return self._world_size

    @property
    def elastic_world_sizes(self) -> Tuple[int, ...]:
        """With elasticity enabled, every world size the elastic batch size suits; else empty."""
        return self._elastic_world_sizes
