"""The engine's checkpoint members, DeepSpeed's names and signatures: sharded checkpoints
(``save_checkpoint``, ``load_checkpoint``, ``wait_for_checkpoint``, written and read by
``zengine/checkpoint/``) and the whole model in the compute dtype (``save_16bit_model`` and its
older name, ``_zero3_consolidated_16bit_state_dict``).

``Engine`` takes these by inheritance, as it takes members.py's; each is a collective that meets the
other ranks first (``distributed/agreement.py``) and hands the engine to the checkpoint layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .. import checkpoint
from ..checkpoint.export.model16 import (
    consolidated_state_dict,
    save_16bit_model as write_16bit_model,
)
from ..checkpoint.native import background
from ..distributed import agreement
from ..distributed.agreement import collective_call
from ..log import setup_logging

if TYPE_CHECKING:
    from ..config import ZengineConfig
    from .build import Training

_logger = setup_logging()


def _save_dcp(*args, exclude_frozen: bool = False) -> bool:
    if exclude_frozen:  # (raised on every rank: each passes the same arguments)
        raise NotImplementedError(
            "save_checkpoint(exclude_frozen_parameters=True, checkpoint_format='dcp'): a DCP "
            "checkpoint holds every parameter (get_state_dict's layout); save in zengine's format "
            "to leave the frozen ones out"
        )
    # torch.distributed.checkpoint is imported only when a DCP checkpoint is written
    from ..checkpoint.dcp.save import save_dcp_checkpoint

    return save_dcp_checkpoint(*args)


# the writer of each checkpoint format (the config's checkpoint.checkpoint_format)
SAVERS = {"zengine": checkpoint.save_checkpoint, "dcp": _save_dcp}


class CheckpointMembers:
    """Members of DeepSpeed's engine that save and load (docs/API.md lists them). A mix-in of
    ``Engine``: it reads only these of the engine's members."""

    config: "ZengineConfig"
    global_rank: int
    trains: "Training"

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Optional[str] = None,
        client_state: Optional[dict] = None,
        save_latest: bool = True,
        async_save: Optional[bool] = None,
        exclude_frozen_parameters: bool = False,
        checkpoint_format: Optional[str] = None,
    ) -> bool:
        """Collective: write a sharded checkpoint to ``save_dir/tag`` (default tag ``global_step<N>``)
        atomically, then record ``tag`` in ``save_dir/latest``. Every rank writes only what it holds.
        ``async_save`` (default: the config's ``checkpoint.writer.decoupled``): return after a copy to host
        memory, write in the background (see ``wait_for_checkpoint``). ``exclude_frozen_parameters``
        (DeepSpeed's; the Trainer passes True for a PEFT model): the parameters that do not require
        grad are left out; ``load_checkpoint(load_module_strict=False)`` keeps the model's own values
        of them (strict: they are named missing), and the fp32 exports leave them out (zengine's
        format; with "dcp" it is refused by name).
        ``checkpoint_format`` (default: the config's ``checkpoint.checkpoint_format``): ``"zengine"``, or
        ``"dcp"``, torch.distributed.checkpoint's files in ``get_state_dict``'s layout, which FSDP2 loads
        with ``dcp.load`` + ``set_state_dict`` (checkpoint/dcp/save.py)."""
        if async_save is None:
            async_save = self.config.checkpoint.writer.decoupled
        fmt = checkpoint_format or self.config.checkpoint.checkpoint_format
        if fmt not in SAVERS:
            raise ValueError(
                f"save_checkpoint(checkpoint_format={fmt!r}): one of {', '.join(sorted(SAVERS))}"
            )
        with agreement.collective_call("save_checkpoint"):
            return SAVERS[fmt](
                self,
                save_dir,
                tag,
                client_state,
                save_latest,
                async_save,
                exclude_frozen=exclude_frozen_parameters,
            )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        missing_ok: bool = False,
        load_module_strict: bool = True,
        *,
        trust_client_state: bool = False,
    ):
        """Collective: load ``load_dir/tag`` (default: ``latest``), saved by any world size and stage.

        Returns ``(path, client_state)``. A missing ``load_dir``, ``latest`` or tag raises
        ``CheckpointNotFoundError`` on every rank, unless ``missing_ok=True``: then it returns
        ``(None, None)`` (DeepSpeed's value) and logs it. A damaged checkpoint (a failed checksum, a
        truncated file, an edited meta.json) or an empty ``latest`` raises either way. state.pt loads
        weights-only (tensors, plain values): other objects (in ``client_state``) raise
        ``CheckpointUntrustedError`` unless ``trust_client_state=True``, which may run the file's code.
        ``load_module_strict=False``: parameters and buffers the checkpoint lacks keep their values, those it
        alone has are ignored (both logged); a reshaped one still raises. An engine without an optimizer
        loads the model alone (as DeepSpeed's does)."""
        with agreement.collective_call("load_checkpoint"):
            background.wait(self)  # an asynchronous save still writing: published (or failed) first
            return checkpoint.load_checkpoint(
                self,
                load_dir,
                tag,
                load_optimizer_states and self.trains.has_optimizer,
                load_lr_scheduler_states,
                load_module_only,
                missing_ok,
                trust_client_state=trust_client_state,
                strict=load_module_strict,
            )

    def wait_for_checkpoint(self) -> None:
        """Collective: until the asynchronous checkpoint in flight (``save_checkpoint(async_save=True)``) is
        written and published; raises ``CheckpointSaveError`` on every rank if any rank failed. The next save,
        ``load_checkpoint`` and ``destroy`` (at exit too) wait by themselves."""
        background.wait(self)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Collective: rank 0 writes the full model's state_dict in the compute dtype, module by module.

        At stage 3 this needs ``stage3_gather_16bit_weights_on_model_save`` (as in DeepSpeed): without
        it nothing is written and False is returned, with a warning naming the key.
        """
        zero = self.config.zero_optimization
        if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            if self.global_rank == 0:
                _logger.warning(
                    "save_16bit_model: nothing saved: at stage 3 the full 16-bit weights are gathered "
                    "only with zero_optimization.stage3_gather_16bit_weights_on_model_save true (as in "
                    "DeepSpeed); set it, or export a checkpoint with zengine-to-fp32"
                )
            return False
        with collective_call("save_16bit_model"):
            return write_16bit_model(self, save_dir, save_filename)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether stage 3 gathers the full 16-bit weights to save the model
        (``zero_optimization.stage3_gather_16bit_weights_on_model_save``)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> Optional[dict]:
        """Collective: the full state_dict in the compute dtype on rank 0's host, None elsewhere (DeepSpeed's
        member, which accelerate's ``get_state_dict`` calls); tied weights stay one tensor. Any stage."""
        with collective_call("_zero3_consolidated_16bit_state_dict"):
            return consolidated_state_dict(self, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)
