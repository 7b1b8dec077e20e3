"""The live run's whole ``model.state_dict()``, gathered from every rank (``full_state_dict``)."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..base.formatting import format_bytes
from ..runtime.sharded_state import ShardedState
from .contents import training_device, persistent_buffers, tied_aliases

log = logging.getLogger("zero_fx")


def full_state_dict(state: ShardedState, dtype: Optional[torch.dtype] = None, *,
                    cpu_offload: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """The live run's ``model.state_dict()``, whole: fp32 masters (or ``dtype`` for the
    floating-point ones) gathered from every rank, tied names, persistent buffers. A
    collective: call it on every rank.

    ``cpu_offload`` ([Note: full state dict on rank 0's host]): True streams the dict to
    rank 0's CPU memory one bucket at a time and returns it there; every other rank gets
    ``{}``. False: every rank gets the whole dict on the training device (fine on the
    CPU, where that is the host). None: True unless the parameters are on the CPU.

    [Note: full state dict on rank 0's host]
    Gathering the whole model on the device, on every rank, needs the memory stage 3
    exists to save: with ``cpu_offload`` the device holds one bucket beyond what
    training holds ([Note: streaming whole parameters] in runtime/whole_parameters.py),
    and only rank 0 keeps a copy, in host memory: the one rank that writes the file
    (``torch.save``, ``save_pretrained``). The others return an empty dict, as FSDP2's
    ``get_model_state_dict(options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))`` does, so code written for one runs with the other. Only
    ranks whose values are needed take part: in stages 0-2 without mixed precision
    rank 0 copies its own whole parameters and the others return at once; with a
    hybrid mesh only rank 0's shard group gathers. Host memory on rank 0: the
    model's state dict (in ``dtype``), and nothing more.
    """
    if cpu_offload is not None and not isinstance(cpu_offload, bool):
        raise TypeError(f"cpu_offload must be True, False or None (chosen by the device), not "
                        f"{cpu_offload!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.bfloat16) or None, "
                        f"not {dtype!r}")
    device = training_device(state)
    if cpu_offload is None:
        cpu_offload = device.type != "cpu"
    if not cpu_offload:
        full = state.full_parameters()
        result = {name: value.to(dtype) if dtype is not None and value.is_floating_point()
                  else value for name, value in full.items()}
        _add_aliases_and_buffers(state, result, None)
        return result
    keep = state.world.global_rank == 0
    # every rank of rank 0's shard group gathers with it; under tensor parallelism every
    # "tp" rank of those makes its split parameters whole with it
    needed = keep or (state.world.replica == 0 and (
        state.masters_sharded or state.plan.tensor_parallel is not None))
    result: dict[str, torch.Tensor] = {}
    if needed:
        host = torch.device("cpu")
        for name, value in state.stream_full_parameters(keep, dtype, to=host):
            if keep:
                result[name] = value
    if not keep:
        return {}
    _add_aliases_and_buffers(state, result, torch.device("cpu"))
    log.info("zero_fx: full_state_dict: %d entries, %s on rank 0's host, streamed from %s one "
             "bucket at a time", len(result),
             format_bytes(sum(t.nbytes for t in {id(t): t for t in result.values()}.values())),
             device)
    return result


def _add_aliases_and_buffers(state: ShardedState, result: dict, to: Optional[torch.device]) -> None:
    """Tied names (the same tensor under each) and persistent buffers (copies, on ``to``)."""
    for alias, name in tied_aliases(state.model).items():
        result[alias] = result[name]
    for name, buffer in persistent_buffers(state.model).items():
        result[name] = (buffer.detach().clone() if to is None
                        else buffer.detach().to(to, copy=True))
