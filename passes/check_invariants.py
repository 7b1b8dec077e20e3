"""check_invariants: the graph keeps the promises in passes/README.md, or we stop."""

from __future__ import annotations

import operator

from torch.fx import GraphModule

from .common.host_copies import (is_device_copy, is_device_copy_wait, is_host_copy,
                                 reduction_read_by)
from .common.predicates import (CAPTURED_AT_META, Phase, carried_params, gathered_param,
                                is_collective, is_view, is_wait, kept_through_loss, phase_of,
                                storage_base, written_in_place)
from ..errors import InvariantError


def check_invariants(gm: GraphModule, plan) -> GraphModule:
    """Raise ``InvariantError`` if the graph breaks an invariant; never changes it.

    Checks: every collective has exactly one wait; in stage 3, nothing that
    depends only on a forward-gathered parameter is read by a backward node
    (the full parameter is released at the end of its forward region), except
    the resident parameters the plan names and those ``gather_params`` kept
    through the loss; a gradient streamed to the host is copied after its
    reduction's wait, never from the collective's unwaited result, and shards
    brought from the host are read only through their copy's wait
    ([Note: gradients streamed to the host], [Note: shards brought from the
    host] in passes/common/host_copies.py); every read of a tensor that the step writes in
    place is on the side of the write it was captured on.

    [Note: in-place writes keep their readers' sides]
    The captured graph is not functional: it keeps the model's own in-place ops and those of
    autograd (``topk_weights /= denominator`` in DeepSeek-V3's router, with the clone of the
    weights that autograd saves before it; a BatchNorm's running statistics). Data flow does
    not order a read of a tensor against a later write to it, so a pass that moves or copies
    nodes by data flow alone (a copy moved to the edge of a compiled body, a forward value
    recomputed in the backward) can put a read on the other side of a write, and the step
    computes with other values, silently: the router's update was 7% off while the loss
    agreed to 1e-7. Capture numbers every node (``meta["zero_captured_at"]``, kept by copies);
    after every pass, and after regional compilation reorders the graph, each read of a
    tensor written in place (through any view of it) must be on the side of the write it
    was captured on. Nodes that passes insert carry no number and are not checked: our
    inserted code writes nothing in place.
    """
    for node in gm.graph.nodes:
        if is_collective(node):
            waits = [u for u in node.users if is_wait(u)]
            if len(waits) != 1 or len(node.users) != 1:
                raise InvariantError(
                    f"collective {node.name} must have exactly one user, a wait; has {list(node.users)}"
                )
        elif is_host_copy(node):
            _check_copied_after_reduction(node, reduced=plan.ranks_averaged > 1
                                          or plan.keeps_collectives_at_one)
        elif is_device_copy(node) and [is_device_copy_wait(u) for u in node.users] != [True]:
            raise InvariantError(
                f"{node.name} copies shards to the device; its one reader must be its wait "
                f"(zero_fx.wait_device_copy), but {list(node.users)} read it: a parameter "
                f"would be used before its copy from the host completes")
    if plan.params_sharded:
        _check_release(gm, plan.resident | kept_through_loss(gm))
    check_in_place_order(gm)
    return gm


def check_in_place_order(gm: GraphModule, mover: str = "") -> None:
    """Raise ``InvariantError`` if a read of a tensor that an op writes in place has moved to
    the other side of that write since capture ([Note: in-place writes keep their readers'
    sides]); ``mover``: who reordered the graph, for the message when it is not a pass."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    writes = [(node, {storage_base(w) for w in written}) for node in gm.graph.nodes
              if CAPTURED_AT_META in node.meta and (written := written_in_place(node))]
    if not writes:
        return
    readers: dict = {}
    for node in gm.graph.nodes:
        if CAPTURED_AT_META not in node.meta or is_view(node) or node.target is operator.getitem:
            continue
        for base in {storage_base(i) for i in node.all_input_nodes}:
            readers.setdefault(base, []).append(node)
    for write, bases in writes:
        captured = write.meta[CAPTURED_AT_META]
        for reader in {r for base in bases for r in readers.get(base, ()) if r is not write}:
            if (reader.meta[CAPTURED_AT_META] < captured) != (position[reader] < position[write]):
                side = "before" if reader.meta[CAPTURED_AT_META] < captured else "after"
                raise InvariantError(
                    f"{reader.name} read what {write.name} ({write.target}) changes in place "
                    f"{side} the change when captured, and {'after' if side == 'before' else 'before'} "
                    f"it now{f' ({mover})' if mover else ''}: it would compute with other values "
                    f"than the step you wrote ([Note: in-place writes keep their readers' sides])")


def _check_copied_after_reduction(copy, reduced: bool) -> None:
    """``copy`` reads a reduction's result through its wait (when there is a reduction,
    ``reduced``), never the collective's unwaited result nor the unreduced gradient."""
    read = reduction_read_by(copy)
    unwaited = [n for n in read if is_collective(n) or (
        reduced and not is_wait(n) and not carried_params(n))]
    if unwaited or (reduced and not any(is_wait(n) for n in read)):
        raise InvariantError(f"{copy.name} copies a gradient to the host before its reduction "
                             f"completes: it does not read the reduction's waited result")


def _check_release(gm: GraphModule, resident) -> None:
    forward_full = set()  # forward values that are (views of) a forward-gathered parameter
    for node in gm.graph.nodes:
        gathered = gathered_param(node)
        if gathered is not None and gathered[1] is Phase.FORWARD and gathered[0] not in resident:
            forward_full.add(node)
        elif phase_of(node) is Phase.FORWARD and node.all_input_nodes and all(
            i in forward_full for i in node.all_input_nodes
        ):
            forward_full.add(node)
        elif phase_of(node) is Phase.BACKWARD and node.op != "output":
            leaked = [i for i in node.all_input_nodes if i in forward_full]
            if leaked:
                raise InvariantError(
                    f"backward node {node.name} reads {leaked[0].name}, a forward-gathered "
                    "parameter: the full parameter would stay alive across the step"
                )
