"""``offload_update="device"``: the offloaded optimizer steps on the device, its state
streamed from host memory bucket by bucket.

[Note: the update streamed through the device]
With the masters and the optimizer's state in host memory ([Note: optimizer offload] in
offload.py), the update can run in one of two places. On the host (``"host"``, ZeRO-Offload)
it needs no device memory, but a CPU Adam step is slow: for AdamW about 16 bytes are read
and 12 written per element, at host memory bandwidth. On the device (``"device"``), each
bucket of shards ([Note: buckets by block] in plan/layout.py) is brought to the device:
its masters, their gradients and every tensor of optimizer state the size of a master.
The optimizer then steps on those copies there, with the same object, hyperparameters and
step counters, its param groups narrowed to the bucket's. The updated masters and state go
back to the same host tensors. At stage 3 with ``offload="optimizer"`` each updated master
is also cast into the shard the graph reads straight from its device copy, so the updated
parameters need no copy from the host (with the update on the host, each comes back over
the link in the compute dtype).

The next bucket's copy to the device is issued before this bucket's step, on a side stream
on a GPU, so that it lands while this bucket steps. The copies back are issued on the
compute stream after each bucket's step and awaited once, at the end. The device holds two
buckets' state at a time: (1 + 1 + s) x 4 bytes a bucket element for fp32 masters with s
tensors of state (AdamW: 16). What crosses the host link is the masters, gradients and
state, each way: more bytes than the host update (which brings only the updated parameters
back), traded for the device's memory bandwidth. ``offload_update="auto"`` (the default)
steps on the device when the device budget has room for two buckets beside what stays on
the device between steps (the update runs after the graph, whose working set is free by
then) ([Note: choosing what to offload] in offload_choice.py), and on the host
otherwise, including on the CPU without ``device_memory``.

Per bucket, ``optimizer.step()`` runs once, and so do any hooks registered on it. Tensors
of state that are not the size of a master stay where the optimizer keeps them: Adam's
``step`` counter is a host scalar unless it is capturable. On this CPU-only machine the
copies are real copies (``copy=True``), so a piece of state lost on its way back changes
the next step's numbers: ``tests/test_offload.py`` checks the update against the host's,
bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class _Brought:
    """One bucket on the device: (host master, device copy, its host state) for each shard."""

    names: list[str]
    shards: list[tuple[torch.nn.Parameter, torch.nn.Parameter, dict]]
    landed: Optional[torch.cuda.Event]


def step_through_device(state) -> frozenset:
    """``state.optimizer.step()`` on the device, one bucket of ``state``'s shards at a time
    ([Note: the update streamed through the device]). Returns the names whose device shard
    (stage 3, offload="optimizer") it wrote from the updated copy, which need no copy from
    the host."""
    optimizer, plan, device = state.optimizer, state.plan, state.device
    names = [name for name, shard in state.shards.items() if shard.grad is not None]
    buckets = plan.buckets(names)
    groups = optimizer.param_groups
    every_group = [group["params"] for group in groups]
    group_of = {id(p): index for index, params in enumerate(every_group) for p in params}
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    fresh = set()
    try:
        incoming = _bring(state, buckets[0], side) if buckets else None
        for index in range(len(buckets)):
            current = incoming
            incoming = _bring(state, buckets[index + 1], side) if index + 1 < len(buckets) else None
            if current.landed is not None:
                compute = torch.cuda.current_stream(device)
                compute.wait_event(current.landed)
                for _, copy, _ in current.shards:  # made on the side stream, used here
                    for tensor in (copy, copy.grad, *optimizer.state.get(copy, {}).values()):
                        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                            tensor.record_stream(compute)
            for number, group in enumerate(groups):
                group["params"] = [copy for host, copy, _ in current.shards
                                   if group_of[id(host)] == number]
            optimizer.step()
            fresh.update(_cast_into_device_shards(state, current))
            _send_back(optimizer, current)
    finally:
        for group, params in zip(groups, every_group):
            group["params"] = params
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the host reads the masters next
    return frozenset(fresh)


def _cast_into_device_shards(state, brought: _Brought) -> list[str]:
    """Stage 3 with the shards the graph reads on the device: each updated master cast into
    its shard there, from the copy already on the device (nothing crosses the host link)."""
    if not (state.plan.params_sharded and state.device_shards) or state.plan.offloads_parameters:
        return []
    for name, (_, copy, _) in zip(brought.names, brought.shards):
        state.device_shards[name].copy_(copy.detach())
    return brought.names


def _bring(state, names: list[str], side) -> _Brought:
    """Issues the copies of one bucket's masters, gradients and state to the device."""
    optimizer, device = state.optimizer, state.device
    shards = []
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for name in names:
            host = state.shards[name]
            copy = torch.nn.Parameter(_to(host.detach(), device), requires_grad=host.requires_grad)
            copy.grad = _to(host.grad, device)
            kept = optimizer.state.pop(host, {})
            if kept:
                optimizer.state[copy] = {key: _to(value, device) if _per_element(value, host)
                                         else value for key, value in kept.items()}
            shards.append((host, copy, kept))
        landed = side.record_event() if side is not None else None
    return _Brought(list(names), shards, landed)


def _send_back(optimizer: torch.optim.Optimizer, brought: _Brought) -> None:
    """Issues the copies of one stepped bucket's masters and state back into host memory."""
    for host, copy, kept in brought.shards:
        host.data.copy_(copy.detach(), non_blocking=True)
        back = {}
        for key, value in optimizer.state.pop(copy, {}).items():
            if _per_element(value, copy):
                target = kept.get(key)
                if not isinstance(target, torch.Tensor) or target.shape != value.shape \
                        or target.dtype != value.dtype:
                    target = torch.empty(value.shape, dtype=value.dtype, device=host.device,
                                         pin_memory=value.device.type == "cuda")
                value = target.copy_(value, non_blocking=True)
            back[key] = value
        if back:
            optimizer.state[host] = back


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy on ``device`` (a real copy even where the host is the device)."""
    return tensor.to(device, copy=True, non_blocking=True)


def _per_element(value, shard: torch.Tensor) -> bool:
    """State the size of a master (Adam's moments), as opposed to a scalar (its ``step``)."""
    return isinstance(value, torch.Tensor) and value.shape == shard.shape and value.dim() > 0
