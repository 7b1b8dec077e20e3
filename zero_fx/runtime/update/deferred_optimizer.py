"""``opt.step()`` and ``opt.zero_grad()`` inside the captured step only record that they
ran; after the compiled graph, the update runs on the shards (``OptimizerUpdate``), with the
optimizer's companions (schedulers, GradScaler, clipping: companions.py) in the step's order."""

from __future__ import annotations

import contextlib
from typing import Optional

from ...capture.step_calls import (ZERO_GRAD_KEEPS_ZEROS, check_step_calls, traced_step,
                                  traced_zero_grad, watching)
from ...capture.step_graph import CaptureError
from .companions import Recorders, check_companions, outside_window, recording, run_window
from ..distributed.failures import (FenceFailed, failed_after_update, failed_before_update,
                       failed_in_graph_update, fence_failed, is_communication_failure)
from ..step_runner import entered
from .optimizer_set import members
from .update import OptimizerUpdate

MEMBER_STEP = "member step"
"""The event of the k-th optimizer's ``step()`` (k >= 1) in a step of several; the first's is
"step", at which the update of all of them runs."""
MEMBER_ZERO_GRAD = "member zero_grad"
"""The event of the k-th optimizer's ``zero_grad()``."""


class _MemberRecorder:
    """What the k-th optimizer's ``step`` and ``zero_grad`` (k >= 1) become inside the step."""

    def __init__(self, calls: list, index: int):
        self.calls, self.index = calls, index

    def step(self, *args, **kwargs):
        self.calls.append((MEMBER_STEP, self.index))

    def zero_grad(self, set_to_none: bool = True):
        self.calls.append((MEMBER_ZERO_GRAD, self.index, set_to_none))


def check_members_called(calls: list, optimizers: list) -> None:
    """Raise ``CaptureError`` unless each of several optimizers was stepped once and zeroed the
    way the first was ([Note: several optimizers in one step])."""
    if len(optimizers) < 2:
        return
    keeps_zeros = ZERO_GRAD_KEEPS_ZEROS in calls
    for index, optimizer in enumerate(optimizers[1:], start=1):
        name = f"the step's optimizer {index + 1} ({type(optimizer).__name__})"
        steps = sum(1 for c in calls if isinstance(c, tuple) and c[:2] == (MEMBER_STEP, index))
        if steps != 1:
            raise CaptureError(f"{name} is stepped {steps} times in a call; zero_fx updates every "
                               f"optimizer of the step together, once per call: call its step() "
                               f"once, after loss.backward(). Nothing was updated.")
        zeroed = [c[2] for c in calls if isinstance(c, tuple) and c[:2] == (MEMBER_ZERO_GRAD, index)]
        if not zeroed:
            raise CaptureError(f"{name} is never zeroed; call its zero_grad() after its step(). "
                               f"Nothing was updated.")
        if any(set_to_none == keeps_zeros for set_to_none in zeroed):
            raise CaptureError(
                "the step's optimizers zero their gradients differently (set_to_none=False for "
                "some, True for others); zero_fx keeps one kind for the whole step: give every "
                "zero_grad() the same set_to_none. Nothing was updated.")


class DeferredOptimizerCalls:
    """The optimizer calls of one call of the step, and the update they stand for."""

    def __init__(self, step_globals: Optional[dict] = None):
        self.calls: list = []
        """The step's optimizer calls in order: "step", "zero_grad", and the companions'
        events ([Note: the optimizer's companions] in companions.py)."""
        self._recorders = Recorders(self.calls)
        self._step_globals = step_globals
        """The step's module globals: a clipping function imported there is swapped too."""
        self._members: list[_MemberRecorder] = []
        """The recorders of the second optimizer on, for several ([Note: several optimizers in
        one step]); made once, so dynamo's guards on them hold."""
        self.broken = ""
        """Why the step refuses calls (an update failed half-way, so ranks may differ);
        "" if it does not."""

    @contextlib.contextmanager
    def deferring(self, optimizer):
        """Inside, ``optimizer.step()`` and ``optimizer.zero_grad()`` only record that they ran
        (each optimizer's, for several: [Note: several optimizers in one step] in
        optimizer_set.py). Yields each optimizer's own ``step`` (a scheduler's wrapper of it, if
        one wrapped it), in member order, which the update in the graph calls ([Note: the
        update in the graph])."""
        self.calls.clear()
        optimizers = members(optimizer)
        while len(self._members) < len(optimizers) - 1:
            self._members.append(_MemberRecorder(self.calls, len(self._members) + 1))
        saved = [{k: o.__dict__[k] for k in ("step", "zero_grad") if k in o.__dict__}
                 for o in optimizers]
        first = optimizers[0]
        real_steps = [kept.get("step") or type(o).step.__get__(o)
                      for o, kept in zip(optimizers, saved)]
        first.step, first.zero_grad = self._record_step, self._record_zero_grad
        for member, recorder in zip(optimizers[1:], self._members):
            member.step, member.zero_grad = recorder.step, recorder.zero_grad
        try:
            with recording(self._recorders, self._step_globals), watching(optimizer.param_groups):
                yield real_steps
        finally:
            for member, kept in zip(optimizers, saved):
                del member.step, member.zero_grad
                member.__dict__.update(kept)

    # Same function objects on every call, so dynamo's guards on them hold.
    # Each also notes the call while dynamo traces, so the backend checks the calls before
    # it compiles ([Note: checking the step's calls before compiling] in capture/step_calls.py).
    def _record_step(self, *args, **kwargs):
        traced_step()
        self.calls.append("step")

    def _record_zero_grad(self, set_to_none: bool = True):
        traced_zero_grad(keeps_zeros=not set_to_none)
        self.calls.append("zero_grad")
        if not set_to_none:
            self.calls.append(ZERO_GRAD_KEEPS_ZEROS)

    def run(self, update: OptimizerUpdate, rank: int, observers: list) -> None:
        """Check the step made the calls zero_fx needs, then accumulate the gradient shards
        and, at the end of an accumulation window, update the shards."""
        check_step_calls([c for c in self.calls if isinstance(c, str)])
        check_members_called(self.calls, members(update.state.optimizer))
        check_companions(self.calls, update)
        update.keeps_zero_grads = ZERO_GRAD_KEEPS_ZEROS in self.calls
        with entered(observers):
            try:
                ready = update.accumulate()
            except RuntimeError as err:
                if not is_communication_failure(err):
                    raise
                update.discard()
                raise self.error_before_update(update, rank, err) from err
            if not ready:
                outside_window(self.calls)
            else:
                try:
                    run_window(self.calls, update)  # update.apply() at opt.step()
                except RuntimeError as err:
                    if not is_communication_failure(err):
                        raise
                    failure = failed_after_update(rank, err)
                    self.broken = str(failure)
                    raise failure from err
            update.fence()

    def error_in_graph(self, update: OptimizerUpdate, rank: int,
                       err: BaseException) -> BaseException:
        """The error for a collective of the graph that failed: before any update, or, where
        the graph had already stepped a bucket ([Note: the update in the graph]), after one:
        ranks may then hold different parameters, and the step refuses further calls."""
        if not update.in_graph.changed:
            return self.error_before_update(update, rank, err)
        failure = failed_in_graph_update(rank, err)
        self.broken = str(failure)
        return failure

    def error_before_update(self, update: OptimizerUpdate, rank: int,
                            err: BaseException) -> BaseException:
        """The error for a collective of this call that failed before its update: that nothing
        of this call was updated, once the earlier calls' fences say their updates stand (a
        failed one is raised instead: [Note: failures on NCCL])."""
        self.confirm(update, rank, everything=True)
        return failed_before_update(rank, err)

    def confirm(self, update: OptimizerUpdate, rank: int, *, everything: bool = False) -> None:
        """Settle the fences of earlier calls ([Note: failures on NCCL]); a failed one breaks
        the step: its update may have been made from incomplete gradients."""
        try:
            update.confirm(everything=everything)
        except FenceFailed as failed:
            failure = fence_failed(rank, failed)
            self.broken = str(failure)
            raise failure from failed.cause
