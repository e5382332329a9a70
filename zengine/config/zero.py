"""The ``zero_optimization`` section: the ZeRO stage, its communication buckets, and where optimizer states
and parameter shards live (``offload_optimizer``, ``offload_param``); and ``aio``, the file I/O that NVMe
offload uses. Older DeepSpeed spellings (``cpu_offload``...) are rewritten here, with a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Tuple

from pydantic import BeforeValidator, Field, model_validator

from .base import Count, Flag, Integer, Number, PositiveSize, Size, _Section

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadOptimizerConfig(_Section):
    """Where optimizer states live and the optimizer step runs (stages 1-3)."""

    AUTO_MEANS_DEFAULT = True
    AUTO_REFUSED = ("device",)

    device: OffloadDevice = Field(
        "none",
        description='"none" keeps states on the device; "cpu" or "nvme" '
        'moves them there and steps on the CPU.',
    )
    nvme_path: Optional[Path] = Field(
        None, description="Directory for swapped states; required with nvme."
    )
    pin_memory: Flag = Field(
        True,
        description="Use page-locked host buffers for faster copies (on a GPU "
        "machine; DeepSpeed's default since 0.19.5).",
    )
    buffer_count: Count = Field(
        4,
        description="Host buffers in the NVMe swap pool; at least the number of "
        "tensors per parameter the optimizer keeps.",
    )
    fast_init: Flag = Field(False, description="Skip writing initial optimizer states to NVMe.")
    ratio: Number = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Partial offload (stage 3, device cpu): the share of the optimizer's sub-groups "
        "(sub_group_size) kept on the host and stepped by CPU-Adam; the first int((1 - ratio) x n) "
        "stay on the device, stepped by torch's Adam(W) (DeepSpeed's rule).",
    )

    @property
    def partial(self) -> bool:
        """True when part of the offloaded optimizer states stay on the device (``ratio`` below 1
        with device cpu; stage 3, which the section's owner checks)."""
        return self.device == "cpu" and self.ratio < 1.0

    @property
    def enabled(self) -> bool:
        """True when optimizer states leave the accelerator."""
        return self.device != "none"


class OffloadParamConfig(_Section):
    """Where stage-3 parameter shards live between uses."""

    AUTO_MEANS_DEFAULT = True
    AUTO_REFUSED = ("device",)

    device: OffloadDevice = Field(
        "none", description='"none" keeps shards on the device; "cpu" or "nvme" moves them there.'
    )
    nvme_path: Optional[Path] = Field(
        None, description="Directory for swapped parameters; required with nvme."
    )
    pin_memory: Flag = Field(
        True,
        description="Use page-locked host buffers for faster copies (on a GPU "
        "machine; DeepSpeed's default since 0.19.5).",
    )
    buffer_count: Count = Field(5, description="Buffers in the NVMe parameter swap pool.")
    buffer_size: PositiveSize = Field(
        100_000_000, description="Elements per NVMe parameter swap buffer."
    )
    max_in_cpu: Size = Field(
        1_000_000_000, description="Parameter elements kept in CPU memory with NVMe offload."
    )

    @property
    def enabled(self) -> bool:
        """True when parameter shards leave the accelerator."""
        return self.device != "none"


def _string_list(value: Any) -> Any:
    """A single string stands for a list of one (as DeepSpeed reads these keys)."""
    return [value] if isinstance(value, str) else value


StringList = Annotated[List[str], BeforeValidator(_string_list)]

# DeepSpeed's defaults: Hugging Face's mixture-of-experts blocks, whose experts run by routing
DEFAULT_LEAF_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class LeafModuleConfig(_Section):
    """Stage-3 leaf modules: each gathers its whole subtree when it starts, so that ranks whose inputs route
    through different children (mixture-of-experts) still gather the same parameters in the same order."""

    classes: StringList = Field(
        default_factory=lambda: list(DEFAULT_LEAF_CLASSES),
        description="Module classes, by bare or fully qualified name.",
    )
    names: StringList = Field(
        default_factory=list,
        description="Module paths exactly as model.named_modules() gives them.",
    )
    name_suffixes: StringList = Field(
        default_factory=list, description="Ends of module paths (e.g. \"experts\")."
    )


class ZeroConfig(_Section):
    """ZeRO partitioning: what is sharded across data-parallel ranks, and how it communicates."""

    AUTO_MEANS_DEFAULT = True  # (as DeepSpeed's DeepSpeedZeroConfig: "auto" takes the default)
    AUTO_REFUSED = ("stage",)

    DEPRECATED_KEYS: ClassVar[Dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
    }

    stage: Integer = Field(
        0,
        ge=0,
        le=3,
        description="0: plain data parallel; 1: shard optimizer states; "
        "2: also gradients; 3: also parameters.",
    )
    contiguous_gradients: Flag = Field(
        True,
        description="Copy gradients into one contiguous buffer as they "
        "are produced, avoiding fragmentation.",
    )
    overlap_comm: Flag = Field(
        False,
        description="Overlap gradient reduction with the backward pass (two "
        "buckets in flight); false: each bucket's reduction "
        "completes before backward goes on, the least memory. "
        "Default: true at stage 3, false otherwise.",
    )
    reduce_scatter: Flag = Field(
        True, description="Reduce gradients with reduce-scatter rather than all-reduce."
    )
    reduce_bucket_size: PositiveSize = Field(
        500_000_000, description="Elements reduced in one collective."
    )
    allgather_partitions: Flag = Field(
        True,
        description="Gather updated shards with all-gather rather than a series of broadcasts.",
    )
    allgather_bucket_size: PositiveSize = Field(
        500_000_000, description="Elements all-gathered in one collective."
    )
    offload_optimizer: OffloadOptimizerConfig = Field(
        default_factory=OffloadOptimizerConfig, description="Optimizer state offload (stages 1-3)."
    )
    offload_param: OffloadParamConfig = Field(
        default_factory=OffloadParamConfig, description="Parameter offload (stage 3 only)."
    )
    sub_group_size: PositiveSize = Field(
        1_000_000_000,
        description="Elements the optimizer steps at a time "
        "when offloaded (tiles the update); 0: "
        "the default.",
    )
    stage3_prefetch_bucket_size: Size = Field(
        50_000_000, description="Parameter elements fetched ahead of use; 0 disables prefetch."
    )
    stage3_param_persistence_threshold: Size = Field(
        100_000, description="Parameters with fewer elements stay whole on every rank."
    )
    stage3_max_live_parameters: Size = Field(
        1_000_000_000, description="Gathered parameter elements allowed at once before releasing."
    )
    stage3_max_reuse_distance: Size = Field(
        1_000_000_000,
        description="Keep a gathered parameter if it is used again within this many elements.",
    )
    stage3_gather_units: Literal["auto", "module"] = Field(
        "auto",
        description=(
            "zengine only: how stage 3 groups its parameter gathers once the first step's order is "
            "recorded. 'auto': consecutive modules' parameters travel as one collective, in groups of "
            "up to stage3_prefetch_bucket_size elements (about a transformer block at the defaults, as "
            "FSDP2's per-block units); 'module': one collective per module (or leaf module), as "
            "DeepSpeed. The values are exact either way; leaf modules are honoured in both. 'auto' also "
            "keeps a used parameter gathered only within the prefetch window and reduces gradients "
            "in buckets of at most that window (FSDP2's lifetimes; 'module' keeps DeepSpeed's "
            "stage3_max_reuse_distance and reduce_bucket_size as given). With "
            "zero_quantized_weights gathers stay one per unit (blockwise scales would mix "
            "neighbours)."
        ),
    )
    stage3_gather_16bit_weights_on_model_save: Flag = Field(
        False, description="Gather the full 16-bit weights when saving the model."
    )
    leaf_module: LeafModuleConfig = Field(
        default_factory=LeafModuleConfig,
        description="Stage-3 leaf modules (data-dependent execution).",
    )
    zero_hpz_partition_size: Count = Field(
        1,
        description=(
            "ZeRO++ hpZ: ranks per group of consecutive ranks (a node: its GPU count) that keep a secondary shard "
            "of each parameter gathered in the forward, so that the backward gathers inside the group; 1: off. "
            "Stage 3 only; must divide the data-parallel world size."
        ),
    )
    zero_quantized_weights: Flag = Field(
        False,
        description=(
            "ZeRO++ qwZ: stage 3's parameter gathers for compute travel as blockwise int8 with an fp32 scale per "
            "256 elements (a quarter of fp32's bytes, half of bf16's); shards, masters and the gathers handed to "
            "the user stay exact."
        ),
    )
    zero_quantized_gradients: Flag = Field(
        False,
        description=(
            "ZeRO++ qgZ: stage 3's gradient reduction sends each rank's gradients as blockwise int8 with an fp32 "
            "scale per 256 elements (an all-to-all), summed in fp32 after dequantizing: a quarter of fp32's "
            "bytes, half of bf16's (int8 by default; zero_quantized_gradients_bits: 4 for DeepSpeed's int4)."
        ),
    )
    zero_quantized_gradients_bits: Literal[8, 4] = Field(
        8,
        description=(
            "ZeRO++ qgZ: the width of the codes zero_quantized_gradients sends: 8 (scale = max / 127 per 256 "
            "elements) or 4 (two codes a byte, scale = max / 7, as DeepSpeed's qgZ: an eighth of fp32's bytes, "
            "a coarser sum: up to max|block| / 14 per rank). Read only with zero_quantized_gradients."
        ),
    )
    mics_shard_size: Integer = Field(
        -1,
        description=(
            "MiCS: shard the model states over groups of this many consecutive ranks (a node, or a few) and "
            "replicate them across the groups; gradients are reduce-scattered inside a group and all-reduced "
            "across the groups. -1 (or the world size): plain stage 3. Stage 3 only; must divide the world size."
        ),
    )
    mics_hierarchical_params_gather: Flag = Field(
        False,
        description=(
            "MiCS: when a shard group spans nodes, gather parameters in two hops (across nodes among the ranks "
            "with the same local rank, then inside each node), so each parameter crosses nodes once per node "
            "rather than once per rank. Needs mics_shard_size; ranks per node from LOCAL_WORLD_SIZE."
        ),
    )
    stage3_debug_fetch_order: Flag = Field(
        False,
        description=(
            "zengine only: every rank records the sequence of stage-3 parameter fetches of the first step and "
            "the ranks compare them, naming the first parameter where they diverge. A diverging order "
            "deadlocks the all-gathers, so this turns a hang into an error. Costs one extra collective."
        ),
    )

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
            warnings.warn(
                f"zero_optimization.{old} is deprecated; use zero_optimization.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
            if old.startswith("cpu_offload"):
                if value:
                    data[new] = {"device": "cpu"}
            else:
                data[new] = value
        for section in ("offload_optimizer", "offload_param"):
            if section in data and data[section] is None:
                del data[section]
        size = data.get("sub_group_size")
        if not isinstance(size, bool) and size in (0, 0.0, "0"):
            # DeepSpeed takes 0 (each parameter its own sub-group; axolotl's configs write it); the size
            # only tiles the offloaded update, so zengine's default stands in for it
            del data["sub_group_size"]
        if data.get("overlap_comm") is None:
            data["overlap_comm"] = _stage_of(data) == 3
        return data, problems

    @model_validator(mode="after")
    def _offload_matches_stage(self) -> "ZeroConfig":
        problems = []
        if self.offload_param.enabled and self.stage < 3:
            problems.append(
                f"offload_param.device: parameter offload ({self.offload_param.device!r}) needs "
                f"stage 3; stage is {self.stage}"
            )
        if self.zero_hpz_partition_size > 1 and self.stage < 3:
            problems.append(
                f"zero_hpz_partition_size: hierarchical partitioning (ZeRO++ hpZ) needs stage 3; stage "
                f"is {self.stage}"
            )
        if self.zero_quantized_gradients and self.stage < 3:
            problems.append(
                f"zero_quantized_gradients: quantized gradient reduction (ZeRO++ qgZ) needs stage 3; "
                f"stage is {self.stage}"
            )
        if self.zero_quantized_weights and self.stage < 3:
            problems.append(
                f"zero_quantized_weights: quantized parameter gathers (ZeRO++) need stage 3; stage is "
                f"{self.stage}"
            )
        problems += self._mics_problems()
        if self.offload_optimizer.enabled and self.stage == 0:
            problems.append(
                f"offload_optimizer.device: optimizer offload ({self.offload_optimizer.device!r}) "
                f"needs stage 1, 2 or 3; stage is 0"
            )
        problems += self._ratio_problems()
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name).device == "nvme" and getattr(self, name).nvme_path is None:
                problems.append(
                    f'{name}.nvme_path: device "nvme" needs nvme_path, a directory on the NVMe drive'
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _ratio_problems(self) -> List[str]:
        """``offload_optimizer.ratio`` below 1 against the stage and device. DeepSpeed 0.19.8 asserts
        stage 3 for it (ZeroConfig.offload_ratio_check) and ignores it when nothing is offloaded; zengine
        refuses the stage by name, warns for device none and refuses nvme, whose swapped sub-groups
        DeepSpeed does not split either."""
        offload = self.offload_optimizer
        if offload.ratio >= 1.0:
            return []
        if self.stage != 3:
            return [
                f"offload_optimizer.ratio: partial offload ({offload.ratio:g}) needs stage 3, as in "
                f"DeepSpeed; stage is {self.stage}. Leave ratio at 1.0 (every state offloaded)"
            ]
        if offload.device == "nvme":
            return [
                f"offload_optimizer.ratio: partial offload ({offload.ratio:g}) keeps part of the states "
                'on the device and steps the rest with CPU-Adam: it needs device "cpu"; with "nvme" '
                "leave ratio at 1.0"
            ]
        if offload.device == "cpu" and self.offload_param.enabled:
            return [
                f"offload_optimizer.ratio: partial offload ({offload.ratio:g}) with offload_param "
                f"({self.offload_param.device!r}) is not implemented in zengine (the device share's "
                "masters would follow the parameter shards to the host); keep the parameters on the "
                "device (offload_param.device none) or leave ratio at 1.0"
            ]
        if offload.device == "none":
            warnings.warn(
                f"zero_optimization.offload_optimizer.ratio {offload.ratio:g} has no effect with "
                'offload_optimizer.device "none": every optimizer state stays on the device (as in '
                "DeepSpeed)",
                stacklevel=2,
            )
        return []

    def _mics_problems(self) -> List[str]:
        """MiCS's keys against the stage and the other features (sizes against the world: zero/mics.py)."""
        if self.mics_shard_size in (-1, 0):  # DeepSpeed's "off"
            if self.mics_hierarchical_params_gather:
                return [
                    "mics_hierarchical_params_gather: needs mics_shard_size (the ranks per shard group)"
                ]
            return []
        if self.mics_shard_size < 1:
            return [
                f"mics_shard_size: expected -1 (off) or a positive number of ranks, got {self.mics_shard_size}"
            ]
        problems = []
        if self.stage < 3:
            problems.append(
                f"mics_shard_size: MiCS shards the parameters, which needs stage 3; stage is {self.stage}"
            )
        if self.zero_hpz_partition_size > 1:
            problems.append(
                "mics_shard_size with zero_hpz_partition_size: MiCS and ZeRO++'s hpZ are two answers to "
                "the same problem (DeepSpeed takes one or the other); keep one of them"
            )
        if self.mics_hierarchical_params_gather and self.zero_quantized_weights:
            problems.append(
                "mics_hierarchical_params_gather with zero_quantized_weights: the two-hop gather sends "
                "exact rows; keep one of them"
            )
        if self.offload_param.device == "nvme" or self.offload_optimizer.device == "nvme":
            problems.append(
                "mics_shard_size with NVMe offload: not supported (ZeRO-Infinity keeps one copy of the "
                "states per rank, MiCS one per shard group); offload to cpu, or drop mics_shard_size"
            )
        return problems


def _stage_of(data: Dict[str, Any]) -> Optional[int]:
    try:
        return int(data.get("stage", 0))
    except (TypeError, ValueError):
        return None


class AioConfig(_Section):
    """Asynchronous file I/O used by NVMe offload."""

    block_size: PositiveSize = Field(1_048_576, description="Bytes per I/O block.")
    queue_depth: Count = Field(8, description="Blocks each I/O thread keeps in flight.")
    thread_count: Count = Field(
        1, description="I/O threads per rank (thread_count x queue_depth blocks in flight)."
    )
    single_submit: Flag = Field(
        False,
        description="DeepSpeed's libaio batching switch; accepted, no effect "
        "(each block is its own request here).",
    )
    overlap_events: Flag = Field(
        True,
        description="DeepSpeed's libaio overlap switch; accepted, no effect "
        "(submission and completion always overlap here).",
    )
