"""The Engine: wraps a model and drives forward, backward and the boundary step.

The engine only orchestrates. What differs between ZeRO stages lives in the
stage optimizer (``zero/``); precision in ``precision/``;
where state lives in ``offload/``; optimizers and schedules in ``optim/``.

One training step through the modules:

    engine(batch)          -> precision.cast_floating -> module.forward
    engine.backward(loss)  -> loss * scale / gas -> autograd (a plain loss.backward()
                              is bracketed and scaled too: backward.py); gradient hooks
                              hand each gradient to the stage's gradient store
                              (zero/grads.py at stages 0-1, zero/reducer.py at 2-3),
                              which reduces buckets as they fill
    engine.step()          -> at the boundary: ZeroOptimizer.step (norm, overflow,
                              clip, torch optimizer on fp32 shards, write-back,
                              gather), then the LR schedule; else count the micro-step
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..activation import settings as activation_checkpointing
from ..checkpoint.native import background
from ..config import ZengineConfig, format_config
from ..config.report import PRINT_FULL_ENV
from ..distributed import diagnose, shm, shutdown
from ..distributed.process_group import ProcessRank
from ..log import setup_logging
from ..monitor import StepReport, build_monitor
from .trial_probe import AutotuningProbe
from ..monitor.timers import BACKWARD, FORWARD, STEP, Timers
from ..precision.cast import cast_inputs
from ..zero import build_zero_optimizer
from ..zero.optimizer import StepOutcome
from ..zero.place import place_model
from ..zero.stages import shard_group
from .accumulation import Accumulation
from .backward import BackwardTracker
from .build import (
    Training,
    buffer_dtype,
    precision_parts,
    UntrainedParameters,
    make_dataloader,
    make_scheduler,
    named_param_groups,
    optimizer_factory,
    route_matmuls,
)
from .compile import CompileMembers, take_user_compile
from .members import DeepSpeedMembers
from .module_guard import ModuleGuard, optimizer_window_drop
from .saving import CheckpointMembers
from .memory import PINNED_HOST, memory_breakdown, model_state_bytes  # noqa: F401 (public names here too)

logger = setup_logging()


class Engine(DeepSpeedMembers, CheckpointMembers, CompileMembers, nn.Module):
    """A model wrapped for ZeRO data-parallel training (see docs/API.md for the members; the
    DeepSpeed accessors beyond training are in members.py)."""

    def __init__(
        self,
        model: nn.Module,
        config: ZengineConfig,
        process_rank: ProcessRank,
        model_parameters: Optional[Iterable] = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        training_data: Optional[torch.utils.data.Dataset] = None,
        collate_fn=None,
    ):
        super().__init__()
        self.config = config
        self.process_rank = process_rank
        # torch.compile(model): train the model inside (compile.py)
        model, user_compiler = take_user_compile(model)
        self.module = model
        # in an autotuner's trial: measure the profile steps, then end the process
        self._probe = AutotuningProbe.for_config(config.autotuning, model)
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self._no_sync = False
        self._step_applied = True
        # boundary steps skipped for a non-finite gradient (DeepSpeed's name)
        self.skipped_steps = 0
        self.accumulation = Accumulation()  # where the engine is in a global batch
        self.held_states: list = []  # (device storage, host copy) pairs offload_states moved; reload_states refills
        self.pinned_spares: list = []  # pinned host copies reload_states gave back, for the next offload_states
        self._warned_idle_step = False
        self._last_report = (time.perf_counter(), 0)
        self.monitor = build_monitor(config, process_rank.rank)  # no-op unless enabled
        self.timers = Timers.for_device(config.wall_clock_breakdown, process_rank.device)  # same
        self._step_report = StepReport(self.monitor, self.timers, fp16=config.fp16.enabled)
        if process_rank.rank == 0:
            full = os.environ.get(PRINT_FULL_ENV, "").lower() == "full"
            logger.info(
                "zengine config (* = changed from default):\n%s",
                format_config(config, changed_only=not full),
            )
        # unless the script configured it
        activation_checkpointing.configure_from_config(config.activation_checkpointing)

        ranks = shard_group(config.zero_optimization, process_rank)  # MiCS: this rank's shard group
        # CPU ranks on one host: the data-parallel group's collectives through shared memory (distributed/shm.py).
        # Released by destroy() only (every rank together), not when __init__ raises below: a failure may be one
        # rank's, and a transport dropped on some ranks only would split the group's collectives.
        self._shared_memory = shm.install_for(
            ranks.group, config.shared_memory, shm.model_bytes(model)
        )
        # (another engine's transport may serve it: memory_breakdown)
        self._shared_memory_group = ranks.group
        # stage 3 (MiCS: over shard groups): cut one parameter at a time
        buffers = buffer_dtype(config)  # data_types.buffer_dtype (None: the compute dtype)
        place_model(model, config.zero_optimization.stage, config.compute_dtype, ranks, buffers)
        self.matmul = route_matmuls(model, config, process_rank)  # bf16 on a CPU without it: fp32
        self.trains = Training.of(optimizer, config)  # without an optimizer: forward only
        named_groups = named_param_groups(model, model_parameters, optimizer, self.trains)
        self._untrained = UntrainedParameters(
            model, named_groups
        )  # named at the step if unfrozen later
        # the forward's precision (torch_autocast or not), the loss scale, the gradient factor
        self.forward_precision, self.scaler, self.grad_factor = precision_parts(config, ranks)
        # every backward is bracketed (backward.py): a plain one the outputs miss opens at its first parameter gradient
        self._backward = BackwardTracker(self._begin_backward, self._end_backward, self.grad_factor)
        self.optimizer = build_zero_optimizer(
            model,
            config,
            named_groups,
            optimizer_factory(optimizer, config, seed=process_rank.rank),
            self.grad_factor,
            ranks,
            self._backward.on_param_grad,
            self.forward_precision.wire_dtypes(model),
        )
        self.lr_scheduler = make_scheduler(lr_scheduler, config, self.optimizer, self.trains)
        self.training_dataloader = (
            make_dataloader(training_data, config, process_rank, collate_fn)
            if training_data is not None
            else None
        )
        self._destroyed = False
        self._compile_as_given(
            user_compiler
        )  # a model compiled before initialize, or the config's compile section
        acc = self.accumulation  # engine.module's zero_grad and casts: followed or refused
        self._module_guard = ModuleGuard(
            model,
            lambda: not acc.between_batches,
            optimizer_window_drop(self.optimizer),
        )
        shutdown.track(self)  # destroy() runs at exit if the script does not call it
        me = weakref.ref(
            self
        )  # a failed collective reports these counters (distributed/diagnose.py)
        diagnose.track_progress(
            lambda: (me().global_steps, me().micro_steps) if me() is not None else (0, 0)
        )
        if config.auto_resume:  # what DeepSpeed users write by hand at the top of their loop
            path, _ = self.load_checkpoint(
                config.auto_resume, missing_ok=True
            )  # (it says when there is none)
            if process_rank.rank == 0 and path is not None:
                logger.info("auto_resume: resumed from %s at step %d", path, self.global_steps)

    def forward(self, *args, **kwargs):
        self._check_alive("forward")
        dtype = self.config.compute_dtype
        with (
            self.timers(FORWARD),
            self.optimizer.forward_context(),
            self.forward_precision.context(),
            cast_inputs(args, kwargs, dtype) as (args, kwargs),  # buffers filled: the caller's
        ):
            out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._backward.hook_outputs(out)  # so that a plain loss.backward() is bracketed
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally, with no communication, until the context exits."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of ``loss`` (in fp32 and bf16 as it is; with fp16 times the loss scale over the
        accumulation steps, as DeepSpeed does, to keep fp16's range: every gradient of the pass carries that
        factor once, whatever its path, and the step divides it out).

        In fp32 and bf16 the division by ``gradient_accumulation_steps`` is applied once, when the step
        turns the summed gradients into the master gradients, so every gradient that reaches a parameter
        counts once whatever path it took: a plain ``loss.backward()`` (see ``backward.py``), a loss built
        from several outputs or from another engine's output, a term computed outside the forward.
        Several backward calls before one ``step()`` add up, as one backward of the summed losses would.
        ``scale_wrt_gas=False`` (HF's Trainer): the loss is already divided by the accumulation steps; the
        pass is recorded as carrying that division, so the step does not divide again."""
        self._check_alive("backward")
        self.trains.require("backward")
        # scale_wrt_gas=False: the caller divided by the accumulation steps already
        factor = self.grad_factor.loss_factor() if scale_wrt_gas else self.scaler.scale
        carried = None if scale_wrt_gas else self.grad_factor.divided_loss_carries()
        scaled = loss.float() * factor if factor != 1.0 else loss
        self._step_report.record_loss(loss, self.is_gradient_accumulation_boundary())
        autograd = (
            self._autograd_context()
        )  # (refuses what compiled autograd cannot run, before any work)
        with self.timers(BACKWARD), self._backward.explicit(carried), autograd:
            try:
                scaled.backward(retain_graph=retain_graph)
            except RuntimeError as e:  # autograd's words for a misuse the stage can name
                raise self.optimizer.explain_backward_error(e) from e
        return loss

    def _begin_backward(self) -> None:
        self.accumulation.backward_since_step = True
        self.optimizer.begin_backward(self.is_gradient_accumulation_boundary(), self._no_sync)

    def _end_backward(self) -> None:
        self.optimizer.end_backward()

    def step(self) -> None:
        """At a boundary: the optimizer step and the LR schedule; else count the micro-step.

        A boundary step is skipped (``was_step_applied()`` False) when the gradient is not finite on any
        rank; a ``step()`` with no backward since the last one does nothing and is not counted.
        """
        self._check_alive("step")
        self.trains.require("step")
        if self._no_sync:
            raise RuntimeError(
                "engine.step() was called inside engine.no_sync(); leave the context first "
                "so that the accumulated gradients are reduced"
            )
        self._backward.check_step()
        self._untrained.check()  # a parameter unfrozen since initialize: stop by name, before any update
        boundary = self.is_gradient_accumulation_boundary()
        if not boundary and not self.accumulation.backward_since_step:
            self._step_applied = False
            self._warn_idle_step()
            return
        self.accumulation.backward_since_step = False
        if boundary:
            with self.timers(STEP):
                try:
                    outcome = self.optimizer.step(self.micro_steps)
                finally:
                    self._backward.end_window()
            self._step_applied = outcome is StepOutcome.APPLIED
            if (
                outcome is StepOutcome.NO_BACKWARD
            ):  # on every rank: nothing happened, nothing is counted
                self._warn_idle_step()
                return
            self.skipped_steps = self.optimizer.nonfinite.skipped
            if self._step_applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._step_report.record_step(self)  # monitors write loss, lr and scale per step
            if self.global_steps % self.config.steps_per_print == 0:
                self._report()
            self._probe.after_step(self)
        self.accumulation.in_progress = not boundary
        self.micro_steps += 1

    def destroy(self) -> None:
        """Finish the collectives in flight and release what the engine runs besides the model: the
        gradient and (stage 3) module hooks, NVMe swap files and their I/O threads.

        The engine cannot train after this; the process group stays (it is the script's, or
        zengine's to close at exit). Runs by itself at exit when the script does not call it
        (``distributed/shutdown.py``). Calling it twice does nothing.
        """
        if self._destroyed:
            return
        self._destroyed = True
        try:
            background.wait(self)  # an asynchronous save in flight is written and published first
        finally:
            background.release_snapshot_memory()  # the pinned buffer kept for the next asynchronous save
            self.pinned_spares.clear()
            self.optimizer.close()
            shm.uninstall(self._shared_memory)
        self.matmul.remove()  # the model's linear layers get their own forward back
        self._module_guard.remove()  # and their zero_grad and _apply
        self._step_report.close()  # the monitor's files and writers

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise RuntimeError(
                f"engine.{what}(): the engine was destroyed (engine.destroy()); build a new one "
                "with zengine.initialize to train again"
            )
        self._module_guard.check(what)  # engine.module moved to another device since initialize

    def _warn_idle_step(self) -> None:
        if not self._warned_idle_step and self.global_rank == 0:
            self._warned_idle_step = True
            logger.warning(
                "zengine: engine.step() with no backward since the last step(): nothing to apply; "
                "it is not counted (call engine.backward(loss) or loss.backward() first)"
            )

    def summon_full_params(
        self,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ):
        """Context manager: inside it ``engine.module``'s parameters are whole.

        With ``writeback`` changes made inside persist into the shards and fp32
        masters; ``rank0_only`` gathers on rank 0 only (others see empty
        tensors); ``offload_to_cpu`` gathers into CPU memory. Also the fast
        path for many forwards without backward (generation) at stage 3:
        inside ``summon_full_params(writeback=False)`` the forward hooks find
        every parameter gathered and move nothing.
        """
        return self.optimizer.summon(writeback, rank0_only, offload_to_cpu, with_grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (the engine also does this after every boundary step)."""
        self.optimizer.zero_grad()

    def _report(self) -> None:
        now = time.perf_counter()
        t0, s0 = self._last_report
        self._last_report = (now, self.global_steps)
        if self.global_rank == 0:
            rate = (self.global_steps - s0) / max(now - t0, 1e-9)
            logger.info(
                "step=%d lr=%s loss_scale=%g grad_norm=%.4g steps/s=%.3f skipped=%s",
                self.global_steps,
                [round(lr, 8) for lr in self.get_lr()],
                self.loss_scale,
                self.get_global_grad_norm() or 0.0,
                rate,
                not self._step_applied,
            )
        self._step_report.report(
            self
        )  # monitor events and the wall-clock breakdown (resets timers everywhere)

    # -- accounting -----------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, by kind, counted from the tensors themselves (``memory.py``)."""
        return memory_breakdown(
            self.module, self.optimizer, shm.for_group(self._shared_memory_group)
        )


DeepSpeedEngine = (
    Engine  # DeepSpeed's name (deepspeed.runtime.engine.DeepSpeedEngine), for isinstance checks
)
