"""The ops that move tensors between host and device inside the step's graph: a reduced
gradient shard streamed to the host, a bucket of host-resident shards brought to the device.

[Note: gradients streamed to the host]
With ``offload="optimizer"`` ([Note: optimizer offload] in zero_fx/runtime/offload.py) the
optimizer steps on the host, so every gradient shard the graph returns is read there. The
reduction code ends, right after the collective's wait (and the division that follows
it), in ``zero_fx::copy_to_host`` of the bucket's shard: the copy is issued as soon as
the bucket is reduced, while the backward goes on, and the graph returns host tensors.

On a GPU the op allocates a pinned host buffer and issues the copy on a side stream
that first waits for the compute stream (where the reduction's result is complete once
its wait has run); the device shard is recorded on that stream, so its memory is not
handed out again before the copy has read it. Nothing in the graph waits for the copy:
the host reads the gradients only after the graph has returned, and
``wait_for_host_copies()`` (called by the step runner then) synchronizes the side stream.
Where host and device are one memory (the CPU) the op is a plain copy, so the graph and
the mathematics are the same ones a GPU runs.

What makes it right is read from the graph by ``check_invariants``
(``copies_after_reductions``): a copy's input descends from a reduction only through
that reduction's wait, never from the collective's unwaited result.

[Note: shards brought from the host]
With ``offload="parameters"`` (stage 3) each parameter's shard, in the compute dtype, lives
in host memory (pinned on a GPU) and is the graph's input. A bucket's gather starts with
``zero_fx::copy_to_device(shards, device)``: on a GPU it allocates the bucket's flat shard
buffer from a side stream's memory and copies each shard into it there, asynchronously,
and ``zero_fx::wait_device_copy`` makes the compute stream wait for those copies and hands
out the buffer (a copy of it on the device: the shard of a bucket, 1/N of what the gather
makes). Both are in the gather's code. The gather's prefetch ([Note: the collective
schedule]) issues the wait where it issues the all-gather, and the copy one bucket
earlier, with the previous gather of its phase: the copy can run on its stream while the
compute between the two gathers' issue points runs, so the all-gather (which starts only
once its input is on the device) need not wait for it (the order of the graph; not yet
measured on a GPU, nor checked in Inductor's lowered code). The price is one more bucket's
shard (1/N of a bucket) on the device at a time.
``check_invariants`` (``device_copies_waited``) reads from the graph that nothing reads a
copy before its wait.
"""

from __future__ import annotations

import torch

from .predicates import carried_params, is_collective, is_wait

HOST = torch.device("cpu")
"""Where offloaded tensors live and host copies go (read by the runtime and the analysis)."""

_copy_streams: dict = {}
_pending: set = set()
_device_copies: dict = {}


@torch.library.custom_op("zero_fx::copy_to_host", mutates_args=())
def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned and asynchronous when it is on a GPU)."""
    on_gpu = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_gpu)
    if not on_gpu:
        return host.copy_(tensor)
    stream = _copy_stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
    tensor.record_stream(stream)
    _pending.add(tensor.device)
    return host


@copy_to_host.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


@torch.library.custom_op("zero_fx::copy_to_device", mutates_args=())
def copy_to_device(shards: list[torch.Tensor], device: str) -> torch.Tensor:
    """The 1-D concatenation of host ``shards`` on the training device of type ``device``,
    in flight until ``wait_device_copy`` (on a GPU)."""
    if device != "cuda":
        return torch.cat(shards)
    target = torch.device("cuda", torch.cuda.current_device())
    stream = _copy_stream(target)
    with torch.cuda.stream(stream):  # memory the side stream hands out: free of compute's work
        flat = torch.empty(sum(s.numel() for s in shards), dtype=shards[0].dtype, device=target)
        start = 0
        for shard in shards:
            flat[start:start + shard.numel()].copy_(shard.reshape(-1), non_blocking=True)
            start += shard.numel()
        _device_copies[flat.data_ptr()] = torch.cuda.current_stream(target).record_event()
    flat.record_stream(torch.cuda.current_stream(target))
    return flat


@copy_to_device.register_fake
def _(shards: list[torch.Tensor], device: str) -> torch.Tensor:
    return torch.empty(sum(s.numel() for s in shards), dtype=shards[0].dtype, device=device)


@torch.library.custom_op("zero_fx::wait_device_copy", mutates_args=())
def wait_device_copy(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` once ``copy_to_device`` has filled it: the compute stream waits for the copy."""
    if flat.device.type == "cuda":
        torch.cuda.current_stream(flat.device).wait_event(_device_copies.pop(flat.data_ptr()))
    return flat.clone()


@wait_device_copy.register_fake
def _(flat: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(flat)


def wait_for_host_copies() -> None:
    """Block until every copy ``copy_to_host`` issued has landed in host memory."""
    while _pending:
        _copy_stream(_pending.pop()).synchronize()


def _copy_stream(device: torch.device):
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


def is_host_copy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.zero_fx.copy_to_host.default


def is_device_copy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.zero_fx.copy_to_device.default


def is_device_copy_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.zero_fx.wait_device_copy.default


def reduction_read_by(copy: torch.fx.Node) -> list[torch.fx.Node]:
    """The reduction code a copy to the host reads: its inputs, walked back through the
    nodes that carry parameters (the bucket's division and views), each path ending with the
    first wait, collective, or node outside that code it meets (which is in the list).
    Where the copy reads a reduced gradient, a wait ends every path."""
    found, stack = {}, list(copy.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found[node] = None
        if not (is_wait(node) or is_collective(node)) and carried_params(node):
            stack.extend(node.all_input_nodes)
    return list(found)
