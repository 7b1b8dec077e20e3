"""check_invariants: the graph keeps the promises in passes/README.md, or we stop."""

from __future__ import annotations

from typing import Optional

from torch.fx import GraphModule

from .host_copies import (is_device_copy, is_device_copy_wait, is_host_copy,
                          reduction_read_by)
from .predicates import (Phase, carried_params, gathered_param, is_collective, is_wait,
                         kept_through_loss, phase_of)


class InvariantError(AssertionError):
    """A pass produced a graph that breaks an invariant (passes/README.md).

    ``pass_name`` is the pass whose output first broke it, when the pipeline knows
    (``run_pipeline`` checks after every pass): your own pass (``zero_compile(passes=...)``),
    or one of zero_fx's, which is a zero_fx bug: please report it."""

    def __init__(self, message: str, pass_name: Optional[str] = None):
        super().__init__(message)
        self.pass_name = pass_name


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
    host] in passes/host_copies.py).
    """
    for node in gm.graph.nodes:
        if is_collective(node):
            waits = [u for u in node.users if is_wait(u)]
            if len(waits) != 1 or len(node.users) != 1:
                raise InvariantError(
                    f"collective {node.name} must have exactly one user, a wait; has {list(node.users)}"
                )
        elif is_host_copy(node):
            _check_copied_after_reduction(node, reduced=plan.world_size * plan.replicas > 1)
        elif is_device_copy(node) and [is_device_copy_wait(u) for u in node.users] != [True]:
            raise InvariantError(
                f"{node.name} copies shards to the device; its one reader must be its wait "
                f"(zero_fx.wait_device_copy), but {list(node.users)} read it: a parameter "
                f"would be used before its copy from the host completes")
    if plan.stage == 3:
        _check_release(gm, plan.resident | kept_through_loss(gm))
    return gm


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
