"""Typed, validated models of a zengine (DeepSpeed-compatible) JSON config.

Every model forbids unknown keys and re-validates on assignment. Key names,
meanings and defaults follow DeepSpeed's config. Cross-field checks raise one
``ValueError`` whose lines each start with the key path, relative to the
model, followed by ``": "``; ``load.py`` prefixes the model's own path.

Types are strict where JSON's are easy to confuse: a flag takes only true or
false (not 1, not "yes"), and an integer key refuses a boolean and a float
(``"stage": true`` and ``"train_batch_size": 2.0`` are errors), while a
decimal key takes any number but a boolean (``"gradient_clipping": 1`` is
fine). Sizes keep DeepSpeed's spellings (5e8, "5e8"); an integer or decimal
written as a string ("8", "1.0") is read as before. The ``optimizer`` and
``scheduler`` params are checked against the rules the builders in
``zengine.optim`` apply, so they fail here, before any process group starts.
"""
from __future__ import annotations

import difflib
import math
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Tuple

import torch
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, ValidationError,
                      field_validator, model_validator)

from zengine.elasticity import LATEST_VERSION as _LATEST_ELASTICITY_VERSION
from zengine.optim import SCHEDULER_NAMES, optimizer_param_problems, scheduler_param_problems

SUPPORTED_OPTIMIZERS: Tuple[str, ...] = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "CPUAdam", "DeepSpeedCPUAdam")
"""``optimizer.type`` values zengine can build (matched case-insensitively)."""

SUPPORTED_SCHEDULERS: Tuple[str, ...] = SCHEDULER_NAMES
"""``scheduler.type`` values zengine can build (matched case-insensitively)."""

# DeepSpeed optimizers zengine does not build, named so the error says so.
_DEEPSPEED_ONLY_OPTIMIZERS = ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion", "MuAdam", "MuAdamW",
                              "MuSGD", "Muon")


def _whole_number(value: Any) -> Any:
    """Accept 500000000, 5e8, "5e8" or "500_000_000" as the int 500000000."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, not a boolean ({value!r})")
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text.replace("_", ""))
        except ValueError:
            raise ValueError(f'expected a whole number such as 500000000, 5e8 or "5e8"; got {value!r}') from None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        return int(number)
    raise ValueError(f'expected a whole number such as 500000000, 5e8 or "5e8"; got {value!r}')


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, not a boolean ({value!r})")
    return value


def _integer(value: Any) -> Any:
    """Refuse a boolean or a float where an int is expected (pydantic would take true as 1 and
    2.0 as 2); a string must spell an int ("8")."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, not a boolean ({value!r})")
    if isinstance(value, float):
        raise ValueError(f"expected an integer, not a decimal number ({value!r})")
    if isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _auto_is_unset(value: Any) -> Any:
    """Hugging Face configs write "auto" for a batch key the Trainer fills in."""
    return None if value == "auto" else _integer(value)


Integer = Annotated[int, BeforeValidator(_integer)]
"""An int: not a boolean, not a float (even 2.0)."""
Number = Annotated[float, BeforeValidator(_not_bool)]
"""A decimal number; an int is welcome, a boolean is not."""
Flag = StrictBool
"""true or false, nothing else (not 1, not "yes")."""
Size = Annotated[int, BeforeValidator(_whole_number), Field(ge=0)]
"""A count of elements or bytes; 0 is meaningful (e.g. no persistence)."""
PositiveSize = Annotated[int, BeforeValidator(_whole_number), Field(ge=1)]
"""A buffer or bucket size, which must hold at least one element."""
Count = Annotated[int, BeforeValidator(_integer), Field(ge=1)]
"""A small positive count (buffers, threads, steps)."""
BatchSize = Annotated[Optional[Annotated[int, Field(ge=1)]], BeforeValidator(_auto_is_unset)]
"""A batch key; None (or "auto") until ``load_config`` resolves it."""
OffloadDevice = Literal["none", "cpu", "nvme"]


class _Section(BaseModel):
    """Base of every config model: strict keys, checked assignment, finite floats."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        """Rewrite older DeepSpeed spellings in ``data`` (a private copy of the raw section).
        Returns the data to validate and the problems met on the way, ``"key: text"`` lines
        that are reported together with the section's other problems."""
        return data, []

    @model_validator(mode="wrap")
    @classmethod
    def _prepare_then_validate(cls, data: Any, handler: Any) -> Any:
        """``_prepare``, then the fields; a wrap validator rather than a "before" one so that a
        problem met while rewriting (two spellings of one key) does not hide the field problems."""
        problems: List[str] = []
        if isinstance(data, dict):
            data, problems = cls._prepare(dict(data))
        try:
            section = handler(data)
        except ValidationError as error:
            if not problems:
                raise
            raise _with_problems(error, data, problems) from None
        if problems:
            raise ValueError("\n".join(problems))
        return section


def _with_problems(error: ValidationError, data: Any, problems: List[str]) -> ValidationError:
    """``error`` with ``problems`` added as one more error of the section itself."""
    details = [{"type": item["type"], "loc": item["loc"], "input": item["input"],
                **({"ctx": item["ctx"]} if "ctx" in item else {})} for item in error.errors()]
    details.append({"type": "value_error", "loc": (), "input": data,
                    "ctx": {"error": ValueError("\n".join(problems))}})
    return ValidationError.from_exception_data(error.title, details)


def _canonical_type(value: Any, supported: Tuple[str, ...], kind: str, elsewhere: Tuple[str, ...] = ()) -> str:
    """Return the canonical spelling of ``value`` among ``supported``."""
    if not isinstance(value, str):
        raise ValueError(f"the {kind} type must be a string such as {supported[0]!r}; got {value!r}")
    by_lower = {name.lower(): name for name in supported}
    if value.lower() in by_lower:
        return by_lower[value.lower()]
    known = ", ".join(supported)
    article = "an" if kind[0] in "aeiou" else "a"
    if value.lower() in {name.lower() for name in elsewhere}:
        raise ValueError(f"{value!r} is a DeepSpeed {kind} that zengine does not implement; use one of {known}")
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
    raise ValueError(f"{value!r} is not {article} {kind} zengine can build (one of {known}){hint}")


class _NamedSection(_Section):
    """A ``{"type": name, "params": {...}}`` section: the name and the params are both checked
    here, the params with the rules of the builder that will use them."""

    type: str = Field(description="Name, matched case-insensitively and stored in its canonical spelling.")
    params: Dict[str, Any] = Field(default_factory=dict,
                                   description="Keyword arguments of the named type, checked against the "
                                               "parameters it takes and their types and ranges.")

    @field_validator("params", mode="before")
    @classmethod
    def _null_params(cls, value: Any) -> Any:
        return {} if value is None else value


def _raise_param_problems(problems: List[Tuple[str, str]]) -> None:
    """Raise the ``(key, text)`` problems of a section's params, one ``params.<key>: text`` line each."""
    if problems:
        raise ValueError("\n".join(f"params.{key}: {text}" for key, text in problems))


class OptimizerConfig(_NamedSection):
    """The optimizer zengine builds when ``initialize`` is given none (type: one of SUPPORTED_OPTIMIZERS;
    params: lr, betas, eps, weight_decay...)."""

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> str:
        return _canonical_type(value, SUPPORTED_OPTIMIZERS, "optimizer", _DEEPSPEED_ONLY_OPTIMIZERS)

    @model_validator(mode="after")
    def _valid_params(self) -> "OptimizerConfig":
        _raise_param_problems(optimizer_param_problems(self.type, self.params))
        return self


class SchedulerConfig(_NamedSection):
    """The learning-rate scheduler zengine builds when ``initialize`` is given none (type: one of
    SUPPORTED_SCHEDULERS; params: warmup_num_steps...)."""

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> str:
        return _canonical_type(value, SUPPORTED_SCHEDULERS, "scheduler")

    @model_validator(mode="after")
    def _valid_params(self) -> "SchedulerConfig":
        _raise_param_problems(scheduler_param_problems(self.type, self.params))
        return self


class NonFiniteGradientsConfig(_Section):
    """What a boundary step does when the global gradient norm is NaN or Inf (zengine's own key)."""

    skip: Flag = Field(True, description="Skip the step on every rank (counted, logged); false applies it "
                                         "anyway in fp32/bf16 (fp16 with dynamic scaling always skips).")
    max_consecutive_skips: Integer = Field(50, ge=0, description="Raise, naming the first parameter whose "
                                           "gradient is non-finite, after this many skipped steps in a row; "
                                           "0 never raises.")
    warn_every: Count = Field(100, description="Log the first skip, then every this many skips.")


class FP16Config(_Section):
    """float16 mixed precision with loss scaling."""

    enabled: Flag = Field(False, description="Compute in float16, keeping fp32 master weights.")
    loss_scale: Number = Field(0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: Integer = Field(16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: Count = Field(1000, description="Steps without overflow before the dynamic scale doubles.")
    hysteresis: Count = Field(2, description="Overflows tolerated before the dynamic scale is halved.")
    consecutive_hysteresis: Flag = Field(False, description="Refill the hysteresis budget after every step "
                                                            "without overflow.")
    min_loss_scale: Number = Field(1.0, gt=0, description="The dynamic scale never drops below this value.")

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on and the loss scale adapts to overflows."""
        return self.enabled and self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The loss scale that dynamic scaling starts from."""
        return float(2 ** self.initial_scale_power)


class BF16Config(_Section):
    """bfloat16 mixed precision (no loss scaling needed)."""

    enabled: Flag = Field(False, description="Compute in bfloat16, keeping fp32 master weights.")


class _FileMonitorConfig(_Section):
    """A monitor that rank 0 writes into ``output_path/job_name`` every ``steps_per_print`` steps."""

    enabled: Flag = Field(False, description="Write the training events (loss, lr, grad norm, samples/s, "
                                             "memory, breakdown times) on rank 0.")
    output_path: str = Field("", description="Directory in which the job's folder is made; empty: the "
                                             "working directory.")
    job_name: str = Field("DeepSpeedJobName", description="Folder under output_path that receives the files "
                                                          "(DeepSpeed's default name, so paths match).")


class TensorBoardConfig(_FileMonitorConfig):
    """TensorBoard event files (torch.utils.tensorboard; needs the optional tensorboard package)."""


class CSVMonitorConfig(_FileMonitorConfig):
    """One CSV file per event name, rows of step,value (DeepSpeed's csv_monitor layout)."""


class WandbConfig(_Section):
    """A Weights & Biases run that rank 0 logs the training events to (needs the optional wandb package)."""

    enabled: Flag = Field(False, description="Log the training events to wandb on rank 0.")
    group: Optional[str] = Field(None, description="wandb group, to gather related runs.")
    team: Optional[str] = Field(None, description="wandb team (the run's entity).")
    project: str = Field("deepspeed", description="wandb project (DeepSpeed's default name).")


class OffloadOptimizerConfig(_Section):
    """Where optimizer states live and the optimizer step runs (stages 1-3)."""

    device: OffloadDevice = Field("none", description='"none" keeps states on the device; "cpu" or "nvme" '
                                                      'moves them there and steps on the CPU.')
    nvme_path: Optional[Path] = Field(None, description="Directory for swapped states; required with nvme.")
    pin_memory: Flag = Field(False, description="Use page-locked host buffers for faster copies.")
    buffer_count: Count = Field(4, description="Host buffers in the NVMe swap pool; at least the number of "
                                               "tensors per parameter the optimizer keeps.")
    fast_init: Flag = Field(False, description="Skip writing initial optimizer states to NVMe.")

    @property
    def enabled(self) -> bool:
        """True when optimizer states leave the accelerator."""
        return self.device != "none"


class OffloadParamConfig(_Section):
    """Where stage-3 parameter shards live between uses."""

    device: OffloadDevice = Field("none", description='"none" keeps shards on the device; "cpu" or "nvme" '
                                                      'moves them there.')
    nvme_path: Optional[Path] = Field(None, description="Directory for swapped parameters; required with nvme.")
    pin_memory: Flag = Field(False, description="Use page-locked host buffers for faster copies.")
    buffer_count: Count = Field(5, description="Buffers in the NVMe parameter swap pool.")
    buffer_size: PositiveSize = Field(100_000_000, description="Elements per NVMe parameter swap buffer.")
    max_in_cpu: Size = Field(1_000_000_000, description="Parameter elements kept in CPU memory with NVMe "
                                                        "offload.")

    @property
    def enabled(self) -> bool:
        """True when parameter shards leave the accelerator."""
        return self.device != "none"


class ZeroConfig(_Section):
    """ZeRO partitioning: what is sharded across data-parallel ranks, and how it communicates."""

    DEPRECATED_KEYS: ClassVar[Dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
    }

    stage: Integer = Field(0, ge=0, le=3, description="0: plain data parallel; 1: shard optimizer states; "
                                                      "2: also gradients; 3: also parameters.")
    contiguous_gradients: Flag = Field(True, description="Copy gradients into one contiguous buffer as they "
                                                         "are produced, avoiding fragmentation.")
    overlap_comm: Flag = Field(False, description="Overlap gradient reduction with the backward pass (two "
                                                  "buckets in flight); false: each bucket's reduction "
                                                  "completes before backward goes on, the least memory. "
                                                  "Default: true at stage 3, false otherwise.")
    reduce_scatter: Flag = Field(True, description="Reduce gradients with reduce-scatter rather than "
                                                   "all-reduce.")
    reduce_bucket_size: PositiveSize = Field(500_000_000, description="Elements reduced in one collective.")
    allgather_partitions: Flag = Field(True, description="Gather updated shards with all-gather rather than "
                                                         "a series of broadcasts.")
    allgather_bucket_size: PositiveSize = Field(500_000_000, description="Elements all-gathered in one "
                                                                         "collective.")
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig,
                                                      description="Optimizer state offload (stages 1-3).")
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig,
                                              description="Parameter offload (stage 3 only).")
    sub_group_size: PositiveSize = Field(1_000_000_000, description="Elements the optimizer steps at a time "
                                                                    "when offloaded (tiles the update).")
    stage3_prefetch_bucket_size: Size = Field(50_000_000, description="Parameter elements fetched ahead of "
                                                                      "use; 0 disables prefetch.")
    stage3_param_persistence_threshold: Size = Field(100_000, description="Parameters with fewer elements stay "
                                                                          "whole on every rank.")
    stage3_max_live_parameters: Size = Field(1_000_000_000, description="Gathered parameter elements allowed "
                                                                        "at once before releasing.")
    stage3_max_reuse_distance: Size = Field(1_000_000_000, description="Keep a gathered parameter if it is "
                                                                       "used again within this many elements.")
    stage3_gather_16bit_weights_on_model_save: Flag = Field(False, description="Gather the full 16-bit "
                                                                               "weights when saving the model.")
    stage3_debug_fetch_order: Flag = Field(False, description=(
        "zengine only: every rank records the sequence of stage-3 parameter fetches of the first step and "
        "the ranks compare them, naming the first parameter where they diverge. A diverging order "
        "deadlocks the all-gathers, so this turns a hang into an error. Costs one extra collective."))

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        problems = []
        for old, new in cls.DEPRECATED_KEYS.items():
            if old not in data:
                continue
            value = data.pop(old)
            if new in data:
                problems.append(f"{old}: deprecated spelling of {new!r}; give only one of them")
                continue
            if old.startswith("cpu_offload") and not isinstance(value, bool):
                problems.append(f"{old}: expected true or false, got {value!r}")
                continue
            warnings.warn(f"zero_optimization.{old} is deprecated; use zero_optimization.{new}",
                          DeprecationWarning, stacklevel=2)
            if old.startswith("cpu_offload"):
                if value:
                    data[new] = {"device": "cpu"}
            else:
                data[new] = value
        for section in ("offload_optimizer", "offload_param"):
            if section in data and data[section] is None:
                del data[section]
        if data.get("overlap_comm") is None:
            data["overlap_comm"] = _stage_of(data) == 3
        return data, problems

    @model_validator(mode="after")
    def _offload_matches_stage(self) -> "ZeroConfig":
        problems = []
        if self.offload_param.enabled and self.stage < 3:
            problems.append(f"offload_param.device: parameter offload ({self.offload_param.device!r}) needs "
                            f"stage 3; stage is {self.stage}")
        if self.offload_optimizer.enabled and self.stage == 0:
            problems.append(f"offload_optimizer.device: optimizer offload ({self.offload_optimizer.device!r}) "
                            f"needs stage 1, 2 or 3; stage is 0")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name).device == "nvme" and getattr(self, name).nvme_path is None:
                problems.append(f'{name}.nvme_path: device "nvme" needs nvme_path, a directory on the NVMe drive')
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _stage_of(data: Dict[str, Any]) -> Optional[int]:
    try:
        return int(data.get("stage", 0))
    except (TypeError, ValueError):
        return None


class AioConfig(_Section):
    """Asynchronous file I/O used by NVMe offload."""

    block_size: PositiveSize = Field(1_048_576, description="Bytes per I/O block.")
    queue_depth: Count = Field(8, description="Blocks each I/O thread keeps in flight.")
    thread_count: Count = Field(1, description="I/O threads per rank (thread_count x queue_depth blocks in flight).")
    single_submit: Flag = Field(False, description="DeepSpeed's libaio batching switch; accepted, no effect "
                                                   "(each block is its own request here).")
    overlap_events: Flag = Field(True, description="DeepSpeed's libaio overlap switch; accepted, no effect "
                                                   "(submission and completion always overlap here).")


class ActivationCheckpointingConfig(_Section):
    """How ``zengine.checkpointing.checkpoint`` (DeepSpeed's ``deepspeed.checkpointing``) keeps the inputs
    of each checkpointed segment. Recomputation is exact, so none of these changes the numbers."""

    partition_activations: Flag = Field(False, description="Split each saved input across the model-parallel "
                                                           "group; accepted, no effect (zengine has no model "
                                                           "parallelism, so the group is one rank).")
    cpu_checkpointing: Flag = Field(False, description="Keep each checkpointed segment's saved inputs in CPU "
                                                       "memory and copy them back to the device to recompute.")
    contiguous_memory_optimization: Flag = Field(False, description="Copy partitioned inputs into preallocated "
                                                                    "contiguous buffers; accepted, no effect "
                                                                    "(nothing is partitioned here).")
    number_checkpoints: Optional[Count] = Field(None, description="Checkpointed segments per forward, which "
                                                                  "sizes the contiguous buffers; accepted, no "
                                                                  "effect.")
    synchronize_checkpoint_boundary: Flag = Field(False, description="Wait for the accelerator at the start "
                                                                     "and end of every checkpointed forward "
                                                                     "and recomputation (no-op on the CPU).")
    profile: Flag = Field(False, description="Log the time of every checkpointed forward and recomputation.")


class ElasticityConfig(_Section):
    """Elastic training (DeepSpeed's section): one global batch size that many world sizes can train with,
    the micro batch and accumulation steps derived at the world size a run (or a restart) has. When enabled
    it chooses all three batch keys; ``zengine.elasticity`` holds the rule."""

    LATEST_VERSION: ClassVar[float] = _LATEST_ELASTICITY_VERSION

    enabled: Flag = Field(False, description="Choose the batch sizes elastically; train_batch_size, "
                                             "train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                                             "are then not given (see ignore_non_elastic_batch_info).")
    max_train_batch_size: Optional[Count] = Field(None, description="Largest acceptable global batch size; "
                                                                    "required when enabled.")
    micro_batch_sizes: Optional[List[Count]] = Field(None, description="Micro batch sizes per rank that fit "
                                                                       "in memory; required when enabled. At a "
                                                                       "world size the largest usable one is "
                                                                       "chosen.")
    min_gpus: Count = Field(1, description="Smallest data-parallel world size the batch size should suit.")
    max_gpus: Count = Field(10000, description="Largest data-parallel world size the batch size should suit.")
    min_time: Integer = Field(0, ge=0, description="Minimum minutes a run should last before it may be "
                                                   "rescaled, for a scheduler; accepted, no effect in zengine.")
    version: Number = Field(_LATEST_ELASTICITY_VERSION, gt=0, description=(
        "Rule version: 0.1 counts every world size in range, 0.2 only multiples of num_gpus_per_node."))
    ignore_non_elastic_batch_info: Flag = Field(False, description="Ignore (with a warning) batch keys given "
                                                                   "alongside enabled elasticity instead of "
                                                                   "refusing the config.")
    prefer_larger_batch: Flag = Field(True, description="Between batch sizes usable at equally many world "
                                                        "sizes, take the larger (false: the smaller).")
    num_gpus_per_node: Count = Field(1, description="Ranks per node; from version 0.2 only world sizes that "
                                                    "are whole nodes count.")
    model_parallel_size: Count = Field(1, description="Ranks per model replica; zengine has no model "
                                                      "parallelism, so only 1 is accepted.")

    @model_validator(mode="after")
    def _usable_when_enabled(self) -> "ElasticityConfig":
        """The checks across keys; a disabled section is inert (as in DeepSpeed), so only its types are
        checked."""
        if not self.enabled:
            return self
        problems = []
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if getattr(self, key) is None:
                problems.append(f"{key}: required when elasticity is enabled")
        if self.micro_batch_sizes is not None and not self.micro_batch_sizes:
            problems.append("micro_batch_sizes: list at least one micro batch size")
        if self.max_train_batch_size is not None and self.micro_batch_sizes:
            too_large = sorted({m for m in self.micro_batch_sizes if m > self.max_train_batch_size})
            if too_large:
                problems.append(f"micro_batch_sizes: {too_large} exceed max_train_batch_size "
                                f"{self.max_train_batch_size}, so they could never be used")
        if self.max_gpus < self.min_gpus:
            problems.append(f"max_gpus: {self.max_gpus} is less than min_gpus {self.min_gpus}")
        if self.version > self.LATEST_VERSION:
            problems.append(f"version: zengine implements elasticity versions up to {self.LATEST_VERSION}, "
                            f"got {self.version}")
        if self.model_parallel_size != 1:
            problems.append(f"model_parallel_size: zengine has no model parallelism (data parallel only), "
                            f"so it must be 1; got {self.model_parallel_size}")
        if problems:
            raise ValueError("\n".join(problems))
        return self


def precision_problem(fp16: FP16Config, bf16: BF16Config) -> Optional[str]:
    """The message for fp16 and bf16 both enabled, else None. ``load_config`` also
    calls it when other sections fail, so this problem is never hidden by them."""
    if fp16.enabled and bf16.enabled:
        return "fp16.enabled: fp16 and bf16 are both enabled; enable at most one"
    return None


class ZengineConfig(_Section):
    """A whole training config. Build it with ``load_config``, which also resolves the batch sizes."""

    DEPRECATED_KEYS: ClassVar[Dict[str, str]] = {"bfloat16": "bf16"}
    SECTIONS: ClassVar[Tuple[str, ...]] = ("fp16", "bf16", "zero_optimization", "aio", "activation_checkpointing",
                                           "tensorboard", "csv_monitor", "wandb", "elasticity")

    train_batch_size: BatchSize = Field(None, description="Samples per optimizer step over all data-parallel "
                                                          "ranks: micro batch * accumulation steps * world size.")
    train_micro_batch_size_per_gpu: BatchSize = Field(None, description="Samples per forward/backward on one "
                                                                        "rank.")
    gradient_accumulation_steps: BatchSize = Field(None, description="Micro batches accumulated per optimizer "
                                                                     "step.")
    optimizer: Optional[OptimizerConfig] = Field(None, description="Optimizer to build; None when the script "
                                                                   "passes its own.")
    scheduler: Optional[SchedulerConfig] = Field(None, description="LR scheduler to build; None for a constant "
                                                                   "LR or one the script passes.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 mixed precision.")
    gradient_clipping: Number = Field(0.0, ge=0, description="Clip the global gradient norm to this; 0 "
                                                             "disables clipping.")
    steps_per_print: Count = Field(10, description="Log progress every this many optimizer steps.")
    auto_resume: Optional[str] = Field(None, description=(
        "zengine only: a save_dir of engine.save_checkpoint; initialize loads its latest checkpoint when "
        "there is one (a restarted or resubmitted job continues where it was), and starts fresh when not."))
    comm_timeout: Number = Field(300.0, gt=0, description=(
        "zengine only: seconds a collective operation of the process group may wait for the other ranks "
        "before it fails, so a rank that died or diverged ends the run with an error instead of a hang."))
    nonfinite_gradients: NonFiniteGradientsConfig = Field(default_factory=NonFiniteGradientsConfig, description=(
        "zengine only: skip, count and report steps whose gradient is NaN/Inf; stop after too many in a row."))
    wall_clock_breakdown: Flag = Field(False, description="Time forward, backward and step; rank 0 logs the "
                                                          "milliseconds every steps_per_print steps (and the "
                                                          "monitors get them). Synchronizes a GPU at each "
                                                          "timer start and stop.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard "
                                                                                          "monitor.")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig, description="CSV file monitor.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases monitor.")
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage and its "
                                                                                  "settings.")
    aio: AioConfig = Field(default_factory=AioConfig, description="Async I/O for NVMe offload.")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="Settings of zengine.checkpointing (DeepSpeed's deepspeed.checkpointing), applied at "
                    "initialize unless the script called checkpointing.configure itself.")

    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig, description=(
        "Elastic batch sizes: when enabled, one global batch size usable at many world sizes, with the micro "
        "batch and accumulation steps derived at the run's world size."))

    _ignored_keys: Tuple[str, ...] = PrivateAttr(default=())
    _derived_batch_keys: Tuple[str, ...] = PrivateAttr(default=())
    _world_size: Optional[int] = PrivateAttr(default=None)
    _elastic_world_sizes: Tuple[int, ...] = PrivateAttr(default=())

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        problems = []
        data = {key: value for key, value in data.items() if not (key in cls.SECTIONS and value is None)}
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
        problem = precision_problem(self.fp16, self.bf16)
        if problem:
            raise ValueError(problem)
        return self

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
