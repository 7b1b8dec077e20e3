"""What a compiled step holds, read and written: the whole parameters, checkpoints, the full
state dict, and the update's counters."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from .checkpoint import save_load as checkpoint, state_dict
from .runtime.sharded_state import ShardedState
from .runtime.update.optimizer_set import OptimizerSet, same_optimizers


class StepState:
    """``CompiledStep``'s methods on its trained state. A base of ``CompiledStep``: it reads
    the step's ``state``, ``plan``, ``config`` and what its first call set up (``_sharded``,
    ``_deferred``), and shards through ``_shard``."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the model's parameters as the optimizer holds them (fp32 masters under
        mixed precision), gathered from every rank (call on all ranks)."""
        return self._sharded_state().full_parameters()

    def gathered_parameters(self) -> "contextlib.AbstractContextManager[None]":
        """``with step.gathered_parameters(): model(x)``: run the model outside the step.
        In stage 3 the parameters are all-gathered (compute dtype) for the block and freed
        after it, changes discarded; enter it on every rank. Stages 0-2 keep whole
        parameters and need nothing.

        To evaluate or generate without holding the whole model, decorate the evaluation
        with ``zero_compile`` too, taking the model and no optimizer: it runs on this step's
        shards, gathering block by block as training does ([Note: evaluation steps] in
        zero_fx/evaluation.py).

        Cost: in stage 3 every rank holds the whole model on its device for the block (the
        bytes of every parameter in the compute dtype, logged at INFO on entry), on top of
        its shards and optimizer state: the memory stage 3 saves during training. For the
        values alone (to save or export them) use ``full_state_dict(cpu_offload=True)``,
        which holds one bucket at a time and puts the dict in rank 0's host memory."""
        return self._sharded_state().gathered_parameters()

    def save_checkpoint(self, path: str, extra: Any = None) -> None:
        """Write a sharded checkpoint of the model, optimizer, counters, RNG state and
        ``extra`` (anything picklable: your step number, scheduler state) to the folder
        ``path``; every rank writes its part in parallel. A collective: call on every rank.
        Atomic: a crash during the save leaves the previous checkpoint (or none), never a
        half-written one that loads. See the README, "Checkpoints"."""
        state = self._sharded_state()
        update = self._sharded.update
        if update.micro_step:
            raise RuntimeError(
                f"save_checkpoint after call {update.micro_step} of "
                f"{self.config.accumulation_steps} of an accumulation window: the summed gradients "
                "are not saved, so save right after an optimizer step")
        self._confirm_collectives()
        checkpoint.save(state, path, update.counters(), extra)

    def load_checkpoint(self, path: str, model: Optional[torch.nn.Module] = None,
                        optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        """Load a checkpoint written by ``save_checkpoint`` (at any world size and stage) and
        return its ``extra``. Before the step's first call, pass the model and optimizer to
        shard (the same objects the step is then called with). A collective."""
        if isinstance(optimizer, (list, tuple)):  # [Note: several optimizers in one step]
            optimizer = optimizer[0] if len(optimizer) == 1 else OptimizerSet(optimizer)
        if self.state is None:
            if model is None or optimizer is None:
                raise ValueError("load_checkpoint before the step's first call needs the model and "
                                 "optimizer to shard: step.load_checkpoint(path, model, optimizer)")
            self.shard_model(model, optimizer)
        elif (model is not None and model is not self.state.model) or (
                optimizer is not None and not same_optimizers(optimizer, self.state.optimizer)):
            raise ValueError("this compiled step already shards another model or optimizer")
        self._sharded.update.settle()  # an update still running would overwrite what loads
        counters, extra = checkpoint.load(self.state, path)
        self._sharded.update.restore_counters(counters)
        return extra

    def full_optimizer_state(self) -> dict[str, dict]:
        """The optimizer's state by parameter name, each tensor whole (in the parameter's
        shape), as torch.optim holds it when it steps the whole model: to compare with eager,
        or to read a moment. A collective: call it on every rank."""
        state = self._sharded_state()
        self._confirm_collectives()
        return state.full_optimizer_state()

    def full_state_dict(self, dtype: Optional[torch.dtype] = None, *,
                        cpu_offload: Optional[bool] = None) -> dict[str, torch.Tensor]:
        """The model's whole ``state_dict()`` (fp32 masters, or ``dtype`` for floating-point
        tensors; tied names; buffers) for plain PyTorch's ``model.load_state_dict``. A
        collective: call it on every rank.

        ``cpu_offload=True`` (the default when training on a GPU): rank 0 gets the dict in
        CPU memory and every other rank an empty dict ``{}`` (as FSDP2's
        ``StateDictOptions(full_state_dict=True, cpu_offload=True)``); the parameters are
        gathered one bucket at a time and copied to rank 0's host, so the device holds one
        bucket beyond what training holds. Write the file on rank 0:
        ``if rank == 0: torch.save(sd, path)``. ``cpu_offload=False`` (the default on the
        CPU): every rank gets the whole dict, on the training device."""
        state = self._sharded_state()
        self._confirm_collectives()
        return state_dict.full_state_dict(state, dtype, cpu_offload=cpu_offload)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (with ``accumulation_steps=K``, one per K calls;
        steps skipped for an fp16 overflow not counted)."""
        return self._sharded.update.optimizer_steps if self._sharded is not None else 0

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The global gradient norm of the latest optimizer step, before clipping (a float32
        scalar, equal on all ranks); None unless ``max_grad_norm`` or loss scaling is set."""
        return self._sharded.update.last_grad_norm if self._sharded is not None else None

    @property
    def loss_scale(self) -> Optional[float]:
        """The current fp16 loss scale; None without loss scaling."""
        scaler = self._sharded.scaler if self._sharded is not None else None
        return scaler.scale.item() if scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the fp16 gradients overflowed."""
        scaler = self._sharded.scaler if self._sharded is not None else None
        return scaler.skipped_steps if scaler is not None else 0

    def _confirm_collectives(self) -> None:
        """Before writing anything durable: every earlier call's collectives have completed
        (NCCL: waits for the fences; [Note: failures on NCCL]), and the step is not broken."""
        if self._deferred.broken:
            raise RuntimeError(self._deferred.broken)
        self._deferred.confirm(self._sharded.update, self.plan.rank, everything=True)

    def _sharded_state(self) -> ShardedState:
        """The state, with any update still running on the host finished ([Note: the delayed
        update] in runtime/update/update.py)."""
        if self.state is None:
            raise RuntimeError("the step has not run yet, so nothing is sharded")
        self._sharded.update.settle()
        return self.state
