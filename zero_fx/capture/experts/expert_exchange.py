"""Tokens to their experts' ranks and back: the all-to-alls of expert parallelism.

[Note: exchanging rows in fixed shapes]
With expert parallelism ([Note: expert parallelism] in zero_fx/plan/expert_parallel.py)
each rank holds ``E / P`` of a block's experts, and a token's rows travel to the ranks
holding its top-k experts and back. How many rows go to each rank depends on the routing,
but one graph, the same on every rank, holds only fixed shapes. So each exchange is one
op whose shapes are fixed and whose split sizes are values:

- ``exchange_counts``: each rank tells every rank of its expert-parallel group how many
  rows it sends to each of that rank's experts (an even all-to-all of ``E`` counts);
- ``exchange_rows``: the rows themselves (``all_to_all_single`` with uneven splits, read
  from the counts inside the op). A rank receives at most every peer's every token once
  per local expert, ``P * T * min(k, E / P)`` rows: the received buffer has that many,
  the valid rows first, zeros after. Nothing is dropped, whatever the routing.

[Note: expert capacity]
The received buffer's worst case, ``P * T * min(k, E / P)`` rows, is ``P`` times what an
even spread of the tokens sends a rank, and the experts' intermediate activations are
sized like it: at thousands of tokens per rank it costs more memory than splitting the
experts saves (the planner's expert-parallel table shows it). ``zero_compile(
expert_capacity_factor=c)`` bounds it as GShard and Switch Transformer do: each expert
takes at most ``ceil(c * T * k / (E / P))`` rows, ``c`` times its share of an even
spread over the group's ``P * T * k`` (token, expert) pairs, so a rank's buffer is ``E /
P`` times that, about ``c * T * k`` rows. After the counts' exchange each rank knows how
many rows every peer sends each of its experts; it takes them peer by peer (rank 0's
first) until the expert is full, and a second exchange of counts tells each peer how
many of its rows were taken: the first ones of each expert, in its token order. A row
not taken is not sent and its expert output is zero (the token keeps its other experts'
output and its residual), and so is its gradient. Nothing is dropped when no expert
receives more than its capacity; an expert receives at most the group's ``P * T`` tokens,
so ``c >= E / k`` never drops.

Both are custom ops: to the compiler a node with a static output shape that issues its
collective and waits for it (the schedule does not move it: the rows it sends come from
the router just before). ``exchange_rows``' gradient is the same exchange the other way
round.

[Note: the dispatch issued, then waited for]
The dispatch (rows to their experts) is two ops, so that a block's own compute runs while
the rows travel: ``exchange_rows_issue`` starts the all-to-all (``async_op=True``, its
work registered with the buffer the rows arrive in, as functional collectives do) and
returns that buffer; ``exchange_rows_wait`` waits for it and gathers the received rows
in local-expert order, the gather that follows the dispatch anyway, so the wait adds no
copy. Between them the capture puts the block's shared expert (Qwen2-MoE's gated one,
DeepSeek's ``shared_experts``), which reads only the block's input: with expert
parallelism the graph computes it while the rows are in flight, where without it the
shared expert runs after the routed ones. The combine (rows back to their tokens) and
the backward's exchanges still issue and wait in one op: after the combine nothing of
the block is left to overlap with, and the backward's exchange reads the gradient the
local experts just made. What the graph does here is what runs with the eager and
aot_eager backends; under Inductor the order inside a compiled body is its scheduler's
(the two ops and the shared expert's matmuls are kernels of their own, kept in graph
order in the programs read so far, not pinned). The cost model still prices the dispatch
as blocking. Each op's ``tokens`` side (the rows a rank sends out in the dispatch, receives back
in the combine) is always ``T * k`` rows: what ``traffic()`` and ``counting_collectives()``
count for it, so that both are the same on every rank and at every step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ...base.collective_backends import backend_serving

Tensor = torch.Tensor


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


@torch.library.custom_op("zero_fx::exchange_counts", mutates_args=())
def exchange_counts(counts: Tensor, group_name: str) -> Tensor:
    """``counts`` (P * El,): how many rows this rank sends to each expert of the group, rank
    by rank; returns (P * El,): how many rows each peer sends to each of this rank's experts,
    peer by peer."""
    group = _group(group_name)
    if backend_serving(counts.device.type, group) == "fake":
        # a simulated world (one process for every rank): as if every peer routed as this
        # rank did, so that the rows' exchange sizes its buffers as a real run would
        return counts.clone()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


@exchange_counts.register_fake
def _(counts: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(counts)


@torch.library.custom_op("zero_fx::exchange_rows", mutates_args=())
def exchange_rows(rows: Tensor, send: Tensor, receive: Tensor, out_rows: int,
                  group_name: str) -> Tensor:
    """Send ``rows``' first ``sum(send)`` rows, ``send[p]`` of them to peer ``p`` in order;
    return ``out_rows`` rows: ``receive[p]`` from each peer ``p`` in order, then zeros."""
    return _send_rows(rows, send, receive, out_rows, group_name, async_op=False)[0]


def _send_rows(rows: Tensor, send: Tensor, receive: Tensor, out_rows: int, group_name: str,
               async_op: bool):
    """The buffer of ``out_rows`` rows the peers' rows arrive in, and the all-to-all's work
    (None unless ``async_op``)."""
    send_splits, receive_splits = send.tolist(), receive.tolist()
    sent, received = sum(send_splits), sum(receive_splits)
    if received > out_rows or sent > rows.shape[0]:
        raise RuntimeError(
            f"expert parallelism: this rank would receive {received} rows into a buffer of "
            f"{out_rows} (or send {sent} of {rows.shape[0]}): the ranks of an expert-parallel "
            "group must run the same step on batches of the same shape")
    out = rows.new_zeros(out_rows, *rows.shape[1:])
    work = dist.all_to_all_single(out[:received], rows[:sent].contiguous(), receive_splits,
                                  send_splits, group=_group(group_name), async_op=async_op)
    return out, work


@exchange_rows.register_fake
def _rows_received(rows: Tensor, send: Tensor, receive: Tensor, out_rows: int,
                   group_name: str) -> Tensor:
    return rows.new_empty(out_rows, *rows.shape[1:])


@torch.library.custom_op("zero_fx::exchange_rows_issue", mutates_args=())
def exchange_rows_issue(rows: Tensor, send: Tensor, receive: Tensor, out_rows: int,
                        group_name: str) -> Tensor:
    """``exchange_rows`` issued, not waited for ([Note: the dispatch issued, then waited
    for]): returns the buffer the rows arrive in, which ``exchange_rows_wait`` reads."""
    out, work = _send_rows(rows, send, receive, out_rows, group_name, async_op=True)
    if work is not None:
        torch._C._distributed_c10d._register_work(out, work)
    return out


exchange_rows_issue.register_fake(_rows_received)


@torch.library.custom_op("zero_fx::exchange_rows_wait", mutates_args=())
def exchange_rows_wait(received: Tensor, order: Tensor) -> Tensor:
    """Wait for ``exchange_rows_issue``'s rows to arrive in ``received``; its rows in
    ``order`` (the gather that follows every dispatch, so the wait copies nothing more)."""
    torch.ops._c10d_functional.wait_tensor(received)
    return received.index_select(0, order)


@exchange_rows_wait.register_fake
def _(received: Tensor, order: Tensor) -> Tensor:
    return received.new_empty(order.shape[0], *received.shape[1:])


def _wait_setup_context(ctx, inputs, output):
    received, order = inputs
    ctx.save_for_backward(order)
    ctx.rows = received.shape[0]


def _wait_backward(ctx, grad):
    (order,) = ctx.saved_tensors
    return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add(0, order, grad), None


exchange_rows_wait.register_autograd(_wait_backward, setup_context=_wait_setup_context)


def _setup_context(ctx, inputs, output):
    rows, send, receive, out_rows, group_name = inputs
    ctx.save_for_backward(send, receive)
    ctx.in_rows, ctx.group_name = rows.shape[0], group_name


def _backward(ctx, grad):
    send, receive = ctx.saved_tensors
    return (exchange_rows(grad.contiguous(), receive, send, ctx.in_rows, ctx.group_name),
            None, None, None, None)


exchange_rows.register_autograd(_backward, setup_context=_setup_context)
exchange_rows_issue.register_autograd(_backward, setup_context=_setup_context)  # the same rows


def expert_capacity(tokens: int, degree: int, experts: int, top_k: int,
                    capacity_factor: float) -> int:
    """Rows one expert takes ([Note: expert capacity]): ``capacity_factor`` times its share of
    an even spread, at most every token of the expert-parallel group."""
    return min(math.ceil(capacity_factor * tokens * top_k * degree / experts), degree * tokens)


def received_rows(tokens: int, degree: int, experts: int, top_k: int,
                  capacity_factor: Optional[float] = None) -> int:
    """Rows of a rank's buffer of received rows, for ``tokens`` tokens a rank: the worst
    case ([Note: exchanging rows in fixed shapes]), or its experts' capacities if smaller
    ([Note: expert capacity])."""
    local = experts // degree
    worst = degree * tokens * min(top_k, local)
    if capacity_factor is None:
        return worst
    return min(worst, local * expert_capacity(tokens, degree, experts, top_k, capacity_factor))


def dispatch_and_combine(rows: Tensor, counts: Tensor, expert_of_row: Tensor, run_local_experts,
                         *, degree: int, top_k: int, group_name: str,
                         capacity_factor: Optional[float] = None, meanwhile=None):
    """``rows`` (T * k, hidden), sorted by expert (``expert_of_row``), ``counts`` (E,) rows
    per expert: send each row to the rank holding its expert, run ``run_local_experts(rows,
    offs, group_of_row)`` there on the received rows sorted by local expert, and bring the
    results back in ``rows``' order ([Note: exchanging rows in fixed shapes]). With
    ``capacity_factor``, each expert takes at most its share of the rows ([Note: expert
    capacity]); a row it does not take comes back zero. ``meanwhile()``, if given, runs
    while the rows travel to their experts ([Note: the dispatch issued, then waited for]),
    and the call returns ``(rows, its result)``."""
    local = counts.shape[0] // degree
    tokens = rows.shape[0] // top_k
    received_counts = exchange_counts(counts, group_name)          # (P * El,), peer-major
    capacity = received_rows(tokens, degree, counts.shape[0], top_k, capacity_factor)
    if capacity_factor is None:
        sent_counts, compacted = counts, None
    else:  # [Note: expert capacity]
        per_expert = expert_capacity(tokens, degree, counts.shape[0], top_k, capacity_factor)
        grid = received_counts.view(degree, local)
        earlier = grid.cumsum(0) - grid                            # earlier peers' rows
        received_counts = (per_expert - earlier).clamp(min=0).minimum(grid).reshape(-1)
        sent_counts = exchange_counts(received_counts, group_name)  # (E,): what is taken
        place = torch.arange(rows.shape[0], device=rows.device) - (counts.cumsum(0) - counts)[expert_of_row]
        compacted = torch.argsort((place >= sent_counts[expert_of_row]).to(torch.int8), stable=True)
        rows = rows[compacted]                                     # taken rows first
    send = sent_counts.view(degree, local).sum(1)
    receive = received_counts.view(degree, local).sum(1)
    in_flight = exchange_rows_issue(rows, send, receive, capacity, group_name)
    # the received rows are peer-major, each peer's sorted by expert: sort them by local
    # expert (stable: a peer's rows keep their order); the zero rows after the valid ones last
    ends = received_counts.cumsum(0)
    segment = torch.searchsorted(ends, torch.arange(capacity, device=rows.device), right=True)
    local_expert = torch.where(segment < ends.shape[0], segment % local, local)
    order = torch.argsort(local_expert, stable=True)
    offs = received_counts.view(degree, local).sum(0).cumsum(0).to(torch.int32)
    group_of_row = local_expert[order].clamp(max=local - 1)
    done_meanwhile = meanwhile() if meanwhile is not None else None
    out = run_local_experts(exchange_rows_wait(in_flight, order), offs, group_of_row)
    back = torch.empty_like(out).index_copy(0, order, out)          # peer-major again
    returned = exchange_rows(back, receive, send, rows.shape[0], group_name)
    if compacted is not None:  # dropped rows: zero
        returned = torch.empty_like(returned).index_copy(0, compacted, returned)
    return returned if meanwhile is None else (returned, done_meanwhile)
