"""The ``autotuning`` section: DeepSpeed's autotuner keys, read by ``zengine --autotuning tune|run``.

The tuner (``zengine/autotuning/``) runs the user's script a few steps at a time with candidate configs;
each such trial has this section ``enabled`` with a ``metric_path``, and the engine then measures the
steps from ``start_profile_step`` to ``end_profile_step``, writes the metrics there and ends the process
(``engine/trial_probe.py``), as DeepSpeed's engine does. Without ``metric_path`` the section changes
nothing in a training run. The keys keep DeepSpeed's names and meanings; ``memory_per_rank`` and
``trial_timeout`` (and the memory keys) are zengine's own.
"""

from __future__ import annotations

from typing import Dict, Literal, Optional

from pydantic import Field, model_validator

from .base import Count, Flag, Integer, Number, Size, _Section


class AutotuningConfig(_Section):
    """What the autotuner searches, how it measures and where it writes (see the module doc)."""

    enabled: Flag = Field(
        False,
        description="Set by the tuner in each trial's config: measure the profile steps, write them to "
        "metric_path and end the process.",
    )
    fast: Flag = Field(
        True,
        description="Search stage, offload and micro-batch size only; false also tunes the bucket sizes, "
        "stage-3 gather units and sub_group_size around the best of those.",
    )
    metric: Literal["throughput", "latency"] = Field(
        "throughput",
        description="What the best config maximises: samples per second (throughput) or the inverse of "
        "the step time (latency). DeepSpeed's 'flops' needs its FLOPS profiler and is refused.",
    )
    metric_path: Optional[str] = Field(
        None, description="Set by the tuner: the file a trial writes its measurements to."
    )
    start_profile_step: Count = Field(
        3, description="Optimizer steps run before timing starts (warm-up)."
    )
    end_profile_step: Count = Field(
        5, description="The optimizer step after which a trial ends; steps after start are timed."
    )
    results_dir: str = Field(
        "autotuning_results",
        description="Where ds_config_optimal.json, cmd_optimal.txt, the report and the plot go.",
    )
    exps_dir: str = Field(
        "autotuning_exps", description="One folder per trial: its config, log and metrics."
    )
    overwrite: Flag = Field(
        True, description="Run the trials again; false reuses the metrics of trials already run."
    )
    tuner_type: Literal["gridsearch", "random", "model_based"] = Field(
        "gridsearch",
        description="Accepted for DeepSpeed configs; zengine always tries candidates in the order its "
        "memory and speed model predicts best.",
    )
    tuner_early_stopping: Count = Field(
        5, description="Stop after this many trials in a row that do not beat the best."
    )
    tuner_num_trials: Count = Field(50, description="At most this many trials.")
    max_train_batch_size: Optional[Count] = Field(
        None, description="Largest global batch (micro batch x accumulation x ranks) to try."
    )
    min_train_batch_size: Count = Field(1, description="Smallest global batch to try.")
    max_train_micro_batch_size_per_gpu: Count = Field(
        1024, description="Largest micro-batch size to try."
    )
    min_train_micro_batch_size_per_gpu: Count = Field(
        1, description="Smallest micro-batch size to try."
    )
    num_tuning_micro_batch_sizes: Count = Field(
        3,
        description="How many micro-batch sizes per stage and offload choice (largest fitting first).",
    )
    mp_size: Count = Field(
        1, description="Model-parallel degree (zengine has none: only 1 is accepted)."
    )
    arg_mappings: Optional[Dict[str, str]] = Field(
        None,
        description="Config keys the script takes as its own arguments, e.g. "
        '{"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}: each trial passes the '
        "chosen value under that argument as well.",
    )
    model_info: Optional[Dict[str, Integer]] = Field(
        None,
        description="Accepted for DeepSpeed configs ({num_params, hidden_size, ...}); measured instead.",
    )
    model_info_path: Optional[str] = Field(None, description="Accepted for DeepSpeed configs.")
    memory_per_rank: Size = Field(
        0,
        description="zengine only: the bytes one rank may use at its peak. 0 (the default): the device's "
        "memory on a GPU; on a CPU host, the memory available when tuning starts divided by the ranks on it.",
    )
    host_memory_per_rank: Size = Field(
        0,
        description="zengine only, GPU machines: the host bytes one rank may use at its peak, for the "
        "states offload to CPU or NVMe puts there. 0 (the default): the host memory available when tuning "
        "starts divided by the ranks on it. On a CPU host memory_per_rank is the host's budget already.",
    )
    memory_margin: Number = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="zengine only: the share of memory_per_rank (and host_memory_per_rank) kept free "
        "against a run's own variation of its peak (the predictions already bound the measured ones' noise "
        "and, for a stage/offload family not measured yet, the estimator's error).",
    )
    trial_timeout: Number = Field(
        600.0,
        gt=0.0,
        description="zengine only: seconds after which a trial is stopped and recorded.",
    )

    @model_validator(mode="after")
    def _check(self) -> "AutotuningConfig":
        if self.end_profile_step <= self.start_profile_step:
            raise ValueError(
                f"autotuning: end_profile_step ({self.end_profile_step}) must be after "
                f"start_profile_step ({self.start_profile_step}): the steps between them are timed"
            )
        if self.mp_size != 1:
            raise ValueError(
                "autotuning.mp_size: zengine has no model parallelism; remove the key or set 1"
            )
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError(
                "autotuning: min_train_micro_batch_size_per_gpu is above max_train_micro_batch_size_per_gpu"
            )
        return self

    @classmethod
    def _prepare(cls, data):
        if data.get("metric") != "flops":
            return data, []
        del data["metric"]
        return data, [
            "metric: 'flops' needs DeepSpeed's FLOPS profiler, which zengine does not have; use "
            "'throughput' (samples/s, the default) or 'latency'"
        ]
