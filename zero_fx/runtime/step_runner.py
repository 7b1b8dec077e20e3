"""What dynamo calls in place of the captured step: the compiled program, fed this rank's
shards for the parameters, handing the gradient shards it returns to the sharded state."""

from __future__ import annotations

import contextlib
from typing import Optional

from ..passes.common.host_copies import wait_for_host_copies
from .distributed.rank_agreement import GraphSignature, RankAgreement, call_signature
from .sharded_state import ShardedState


class StepRunner:
    """Feeds shards for parameters, hands gradient shards to the state."""

    def __init__(self, compiled, param_names, slots, state: ShardedState, observers: list,
                 agreement: RankAgreement, signature: Optional[GraphSignature],
                 extra_inputs: list, update=None, updates_in_graph: bool = False,
                 writes_groups_after_step: bool = False):
        self.compiled = compiled
        self.update = update
        """The step's ``OptimizerUpdate``, told whether this graph steps the optimizer."""
        self.updates_in_graph = updates_in_graph
        """This graph steps the optimizer per bucket ([Note: the update in the graph] in
        graph_update.py); its gradient outputs are None."""
        self.writes_groups_after_step = writes_groups_after_step
        """The step writes its optimizer's param groups after ``opt.step()`` only ([Note:
        hyperparameters written inside the step] in capture/step_calls.py)."""
        self.extra_inputs = extra_inputs
        """Inputs the graph takes after the step's own (the loss scale), read on every call."""
        self.agreement = agreement
        self.signature = signature
        """What the ranks compare before each call ([Note: checking that ranks agree]);
        None: no check."""
        self.param_names = param_names
        self.slots = slots
        self.state = state
        self.observers = observers
        """Dispatch modes to run the graph under (the CompiledStep's list, which it edits)."""

    def __call__(self, *args):
        inputs = self.state.graph_inputs(self.param_names, args) + self.extra_inputs
        if self.signature is not None:
            others = [a for a, name in zip(args, self.param_names) if name is None]
            self.agreement.check(call_signature(self.signature, others))
        if self.update is not None:
            self.update.graph_stepped = self.updates_in_graph
            if self.writes_groups_after_step:  # before the graph writes them back
                self.update.take_groups_at_call()
        with entered(self.observers):
            outs = list(self.compiled(*inputs))
        if self.state.offloaded:  # the host reads them next ([Note: gradients streamed to the host])
            wait_for_host_copies()
        for index, name in self.slots.items():
            if outs[index] is not None:
                self.state.receive_grad(name, outs[index])
            outs[index] = None  # dynamo assigns this to the full parameter's .grad
        return outs


@contextlib.contextmanager
def entered(modes: list):
    """Enter every dispatch mode of ``modes`` (observers: counters, trackers), in order."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield
