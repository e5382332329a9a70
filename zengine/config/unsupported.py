"""DeepSpeed config keys that zengine knows about but does not implement.

A DeepSpeed config file may carry keys for features zengine lacks. None of
them is silently dropped. Each key in ``UNSUPPORTED_KEYS`` belongs to one of
two classes:

``CHANGES_RESULTS``
    The feature changes what training computes (precision, the batch, the
    gradients, the model). zengine refuses the config with a message naming
    the key, unless the value is *inert*: the section says
    ``"enabled": false`` or the flag holds DeepSpeed's default, so DeepSpeed
    itself would not use the feature. An inert key is accepted and reported
    as ignored.

``IGNORABLE``
    The feature only monitors, logs, tunes speed or memory, or controls a
    DeepSpeed-specific mechanism whose absence cannot change the numbers
    (pinned or partial offload only moves bytes). zengine accepts the key and reports it as ignored.

``screen`` pops every listed key out of a raw config dict before the typed
models see it, so only keys zengine implements reach pydantic, and unknown
keys there are errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

CHANGES_RESULTS = "changes_results"
IGNORABLE = "ignorable"

# A section that a config may spell by DeepSpeed's old name.
_SECTION_ALIASES = {"bf16": "bfloat16"}


@dataclass(frozen=True)
class UnsupportedKey:
    """One DeepSpeed key zengine does not implement.

    ``path`` is the dotted key path, ``effect`` one of ``CHANGES_RESULTS`` or
    ``IGNORABLE``, ``feature`` a few words naming the DeepSpeed feature, and
    ``inert`` (for ``CHANGES_RESULTS`` only) the test for a value under which
    DeepSpeed would not use the feature either, described by ``inert_hint``.
    """

    path: str
    effect: str
    feature: str
    inert: Optional[Callable[[Any], bool]] = None
    inert_hint: str = ""


def _disabled_section(value: Any) -> bool:
    """A section is inert when it is empty, null or says ``"enabled": false``."""
    if value is None or value == {}:
        return True
    return isinstance(value, dict) and value.get("enabled") is False


def _equals(default: Any) -> Callable[[Any], bool]:
    return lambda value: value == default


def _results(path: str, feature: str, inert: Callable[[Any], bool], hint: str) -> UnsupportedKey:
    return UnsupportedKey(path, CHANGES_RESULTS, feature, inert, hint)


def _section(path: str, feature: str) -> UnsupportedKey:
    return _results(path, feature, _disabled_section, 'set "enabled": false')


def _flag(path: str, feature: str, default: Any) -> UnsupportedKey:
    return _results(path, feature, _equals(default), f"set it to {json.dumps(default)}")


def _ignorable(path: str, feature: str) -> UnsupportedKey:
    return UnsupportedKey(path, IGNORABLE, feature)


UNSUPPORTED_KEYS: Tuple[UnsupportedKey, ...] = (
    # Top-level features that change what is trained or how numbers are computed.
    _section("amp", "NVIDIA Apex AMP"),
    _section("sparse_attention", "sparse attention kernels"),
    _section("pipeline", "pipeline parallelism"),
    _section("curriculum_learning", "curriculum learning"),
    _section("data_efficiency", "data efficiency (curriculum, random-LTD)"),
    _section("compression_training", "compression training"),
    _section("quantize_training", "quantization-aware training"),
    _section("weight_quantization", "weight quantization"),
    _section("progressive_layer_drop", "progressive layer drop"),
    _section("hybrid_engine", "the RLHF hybrid engine"),
    _results(
        "tensor_parallel",
        "automatic tensor parallelism",
        lambda v: v is None or (isinstance(v, dict) and v.get("autotp_size", 1) in (0, 1)),
        'set "autotp_size": 1',
    ),
    _flag("sparse_gradients", "sparse (CSR) gradients", False),
    _flag("disable_allgather", "broadcast in place of all-gather", False),
    _flag("dataloader_drop_last", "dropping the last incomplete batch", False),
    # ZeRO sub-keys that change the numbers (quantized frozen weights, LoCo, ZenFlow).
    _flag(
        "zero_optimization.zero_quantized_nontrainable_weights",
        "ZeRO++ quantized frozen weights",
        False,
    ),
    _flag("zero_optimization.zeropp_loco_param", "LoCo-ZeRO++ error feedback", None),
    _flag("zero_optimization.legacy_stage1", "the legacy stage-1 implementation", False),
    _flag("zero_optimization.zenflow", "ZenFlow asynchronous updates", None),
    # Monitoring, logging and profiling (tensorboard, csv_monitor and wandb are implemented: monitor.py).
    _ignorable("comet", "Comet monitor"),
    _ignorable("flops_profiler", "FLOPs profiler"),
    _ignorable("comms_logger", "communication logger"),
    _ignorable("timers", "throughput timers"),
    _ignorable("memory_breakdown", "memory breakdown logging"),
    _ignorable("dump_state", "engine state dump"),
    _ignorable("eigenvalue", "eigenvalue monitor"),
    _ignorable("vocabulary_size", "vocabulary size hint"),
    # Mechanisms whose absence does not change the numbers.
    # The checkpoint section: tag_validation, load_universal, checkpoint_format and writer are
    # config/checkpoint.py's; the rest is not implemented.
    _flag(
        "checkpoint.use_node_local_storage",
        "node-local checkpoint storage (zengine's checkpoints need one "
        "folder every rank can reach)",
        False,
    ),
    *(
        _ignorable(f"checkpoint.writer.{key}", "a checkpoint writer tuning setting")
        for key in ("io_buffer_size", "io_buffer_double", "show_statistics", "data_parallel")
    ),
    _ignorable(
        "checkpoint.parallel_write",
        "pipeline-stage parallel checkpoint writes (no pipeline parallelism)",
    ),
    # managed_gradient_accumulation false: every step() a boundary; zengine counts micro-steps (its default)
    _flag(
        "managed_gradient_accumulation",
        "caller-owned accumulation boundaries (use "
        "engine.set_gradient_accumulation_boundary() or gradient_accumulation_steps instead)",
        True,
    ),
    _ignorable("nebula", "Nebula checkpoint service"),
    # DeepCompile (compile.deepcompile) is refused; its other keys act only with it (config/compile.py).
    _flag(
        "compile.deepcompile",
        "DeepCompile (ZeRO communication rewritten into the compiled graph; "
        "engine.compile() compiles the model with zengine's own hooks instead)",
        False,
    ),
    *(
        _ignorable(f"compile.{key}", "a DeepCompile setting (acts only with compile.deepcompile)")
        for key in (
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_opt_states",
            "double_buffer",
            "symmetric_memory",
            "debug_log",
            "offload_parameters",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
            "passes",
        )
    ),
    _ignorable("graph_harvesting", "CUDA graph harvesting"),
    _ignorable("seq_parallel_comm_data_type", "sequence-parallel communication dtype"),
    _ignorable("use_data_before_expert_parallelism", "MoE process-group layout"),
    _ignorable("zero_allow_untested_optimizer", "untested-optimizer guard"),
    _ignorable("zero_force_ds_cpu_optimizer", "DeepSpeed CPU optimizer guard"),
    _ignorable("optimizer.legacy_fusion", "legacy fused optimizer"),
    _ignorable("fp16.auto_cast", "input auto-cast (zengine always casts floating inputs)"),
    _ignorable("fp16.fused_mode", "fused fp16 optimizer"),
    _ignorable("bf16.immediate_grad_update", "immediate bf16 gradient update"),
    _ignorable("bf16.check_grad_overflow", "bf16 overflow check"),
    _ignorable("aio.use_gds", "GPUDirect Storage"),
    _ignorable("aio.intra_op_parallelism", "async I/O intra-op threads"),
    _ignorable("zero_optimization.round_robin_gradients", "round-robin gradient copy"),
    _ignorable("zero_optimization.ignore_unused_parameters", "unused-parameter check"),
    _ignorable("zero_optimization.load_from_fp32_weights", "fp32 checkpoint weight source"),
    _ignorable("zero_optimization.elastic_checkpoint", "legacy elastic checkpoint"),
    _ignorable("zero_optimization.use_multi_rank_bucket_allreduce", "multi-rank bucket all-reduce"),
    _ignorable("zero_optimization.cpu_offload_use_pin_memory", "deprecated pinned-offload flag"),
    _ignorable("zero_optimization.memory_efficient_linear", "memory-efficient linear"),
    _ignorable("zero_optimization.override_module_apply", "nn.Module.apply override"),
    _ignorable("zero_optimization.pipeline_loading_checkpoint", "pipelined checkpoint loading"),
    _ignorable("zero_optimization.log_trace_cache_warnings", "trace cache warnings"),
    _ignorable("zero_optimization.enable_sanity_checks", "internal sanity checks"),
    _ignorable("zero_optimization.save_muon_momentum_buffer_in_memory", "Muon buffer placement"),
    _ignorable("zero_optimization.stage3_model_persistence_threshold", "stage-3 persistence cap"),
    _ignorable(
        "zero_optimization.stage3_module_granularity_threshold", "stage-3 module granularity"
    ),
    _ignorable(
        "zero_optimization.stage3_use_all_reduce_for_fetch_params", "all-reduce parameter fetch"
    ),
    _ignorable("zero_optimization.stage3_allgather_sequential", "sequential all-gather"),
    _ignorable("zero_optimization.stage3_partition_stream_chunk_size", "streamed partitioning"),
    _ignorable("zero_optimization.offload_optimizer.pipeline", "pipelined NVMe optimizer swap"),
    _ignorable(
        "zero_optimization.offload_optimizer.pipeline_read", "pipelined NVMe optimizer reads"
    ),
    _ignorable(
        "zero_optimization.offload_optimizer.pipeline_write", "pipelined NVMe optimizer writes"
    ),
    _ignorable("zero_optimization.offload_optimizer.super_offload", "Superchip offload"),
    _ignorable(
        "zero_optimization.offload_optimizer.convert_grad_on_cpu", "CPU gradient conversion"
    ),
    _ignorable("zero_optimization.offload_optimizer.cpuadam_cores_perc", "CPU Adam core share"),
)

_BY_PATH: Dict[str, UnsupportedKey] = {entry.path: entry for entry in UNSUPPORTED_KEYS}


def unsupported_keys_under(prefix: str) -> List[str]:
    """The last components of table keys directly under dotted ``prefix``
    ("" for the top level), used for near-miss suggestions."""
    depth = 0 if not prefix else prefix.count(".") + 1
    names = []
    for path in _BY_PATH:
        parts = path.split(".")
        if len(parts) == depth + 1 and ".".join(parts[:-1]) == prefix:
            names.append(parts[-1])
    return names


def _parent_section(raw: Dict[str, Any], parents: List[str]) -> Optional[Dict[str, Any]]:
    node: Any = raw
    for name in parents:
        if not isinstance(node, dict):
            return None
        child = node.get(name)
        if child is None and node is raw and name in _SECTION_ALIASES:
            child = node.get(_SECTION_ALIASES[name])
        node = child
    return node if isinstance(node, dict) else None


def screen(raw: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """Remove every table key from ``raw`` in place.

    Returns ``(problems, ignored)``: one message per key that changes results
    and is not inert, and the dotted paths of keys accepted and ignored.
    """
    from .models import ZengineConfig  # (models.py imports this module's table)

    sections = set(ZengineConfig.model_fields) | set(_SECTION_ALIASES.values())
    problems: List[str] = []
    ignored: List[str] = []
    for key in [
        k for k in raw if isinstance(k, str) and k.split(".", 1)[0] in sections and "." in k
    ]:
        # TRL's prepare_deepspeed adds "zero_optimization.reduce_bucket_size" and the like at the top
        # level; DeepSpeed's top level ignores keys it does not know, so these never take effect there
        raw.pop(key)
        ignored.append(f'"{key}" (a top-level key, not the nested one)')
    for entry in UNSUPPORTED_KEYS:
        *parents, name = entry.path.split(".")
        section = _parent_section(raw, parents)
        if section is None or name not in section:
            continue
        value = section.pop(name)
        if entry.effect == IGNORABLE or entry.inert(value):
            ignored.append(entry.path)
        else:
            problems.append(
                f"{entry.path}: zengine does not implement DeepSpeed's {entry.feature}; "
                f"remove the key (or {entry.inert_hint})"
            )
    return problems, ignored
