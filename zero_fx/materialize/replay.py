"""Run the construction's init events on a meta model, building one module's tensors at a time.

[Note: building one module at a time]
Running the events (``events.py``) in order on real tensors would keep every
tensor whole from its first event to its last: with ``init_fn`` or HuggingFace's
``post_init`` (a second event per module, after all the ``reset_parameters()``),
that is the whole model at once. So there are two passes:

1. Every event runs in order, which moves the random generator exactly as the
   normal construction did. A tensor that only this event writes is built right
   there, in a fresh tensor, and handed on (sliced to this rank's shard in stage
   3, kept whole in stages 0-2). Every other tensor the event touches gets a
   throwaway of its shape, and the generator's state before the event is kept
   (a few KB).
2. The tensors written by several events are built one owner module at a time:
   for each event that writes them, in order, the generator is set to the state
   kept for that event and the event runs again on the real tensors, so they
   receive exactly the numbers pass 1 drew for them. Then they are handed on.

Afterwards the generator is where pass 1 left it: where a normal build leaves
it. Peak memory: this rank's shards, and on the host one module's tensors whole
and the throwaways of one event ([Note: built on the host] in materialize.py).
Fresh floating-point tensors start as NaN: a NaN left
after its events means part of the tensor was never initialized, and a tensor
no event wrote has no values; both are errors that name the tensor and the
module, never uninitialized memory passed on as weights.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.nn as nn

from .events import InitEvent
from .model_tensors import ModelTensor, Slot, own_slots
from .writes import ForeignWrite, WriteWatch
from ..errors import MaterializeError


def replay(tensors: list[ModelTensor], wanted: list[ModelTensor], events: list[InitEvent],
           device: torch.device, put_full: Callable[[ModelTensor, torch.Tensor], None], *,
           tie_owner: Optional[nn.Module] = None) -> list[ModelTensor]:
    """Build each of ``wanted`` by replaying ``events`` and pass it to ``put_full`` ([Note:
    building one module at a time]). Returns the ``wanted`` buffers no event wrote (the
    caller may know how to compute them); a parameter no event wrote is an error.

    ``tie_owner``: the module whose tensor a tie keeps when events ran before the tie
    (HuggingFace: the input embeddings); None: such a tie is ambiguous, see ``_finish``.
    """
    return _Replay(tensors, wanted, events, device, put_full, tie_owner).run()


class _Replay:
    def __init__(self, tensors, wanted, events, device, put_full, tie_owner):
        self.by_id = {id(mt.tensor): mt for mt in tensors}
        self.wanted = wanted
        self.events = events
        self.device = device
        self.put_full = put_full
        self.tie_owner = tie_owner
        self.meta_names = {mt.tensor.untyped_storage()._cdata: mt.name
                           for mt in tensors if mt.is_meta}
        self.slots = [own_slots(event.module, self.by_id) for event in events]
        wanted_ids = {id(mt.tensor) for mt in wanted}
        self.events_of: dict[int, list[int]] = defaultdict(list)
        for index, event in enumerate(events):
            for slot, mt in self.slots[index]:
                found = self.events_of[id(mt.tensor)] if id(mt.tensor) in wanted_ids else None
                if found is not None and _writes(event, slot, mt) and index not in found[-1:]:
                    found.append(index)
        self.writes: dict[int, set[tuple[int, bool]]] = defaultdict(set)
        """tensor id -> (event index, whether that write reaches the tensor itself)"""
        self.unwritten: list[ModelTensor] = []
        self.rng = _Generators(device)

    def run(self) -> list[ModelTensor]:
        single = {tid for tid, found in self.events_of.items() if len(found) == 1}
        snapshots = {}
        for index, event in enumerate(self.events):  # pass 1
            values = {}
            for slot, mt in self.slots[index]:
                tid = id(mt.tensor)
                if tid in single and _writes(event, slot, mt):
                    values.setdefault(tid, self._fresh(mt))
                elif tid in self.events_of and _writes(event, slot, mt):
                    snapshots[index] = None
            if index in snapshots:
                snapshots[index] = self.rng.get()
            self._run(index, values)
            for tid, value in values.items():
                self._finish(self.by_id[tid], value)
        end = self.rng.get()
        groups: dict[int, list[ModelTensor]] = defaultdict(list)  # pass 2, by owner module
        for mt in self.wanted:
            if id(mt.tensor) in self.events_of and id(mt.tensor) not in single:
                groups[id(mt.slots[0].module)].append(mt)
        try:
            for group in groups.values():
                values = {id(mt.tensor): self._fresh(mt) for mt in group}
                for index in sorted({i for mt in group for i in self.events_of[id(mt.tensor)]}):
                    self.rng.set(snapshots[index])
                    self._run(index, values)
                for mt in group:
                    self._finish(mt, values[id(mt.tensor)])
        finally:
            self.rng.set(end)
        self.unwritten += [mt for mt in self.wanted if id(mt.tensor) not in self.events_of]
        for mt in self.unwritten:
            if mt.is_param:
                raise MaterializeError(_no_values(mt, self.events))
        for mt in self.wanted:  # once every event has run: a later module's pre-tie write counts
            if len(mt.slots) > 1:
                self._check_tie(mt, self.writes[id(mt.tensor)])
        return self.unwritten

    def _fresh(self, mt: ModelTensor) -> torch.Tensor:
        value = torch.empty(mt.tensor.shape, dtype=mt.tensor.dtype, device=self.device)
        if value.is_floating_point() or value.is_complex():
            value.fill_(float("nan"))
        return value

    def _run(self, index: int, values: dict[int, torch.Tensor]) -> None:
        """Run event ``index`` with ``values`` bound where it writes them, throwaways elsewhere."""
        event = self.events[index]
        bound, swapped = {}, []
        for slot, mt in self.slots[index]:
            reaches = _writes(event, slot, mt)
            value = values.get(id(mt.tensor)) if reaches else None
            if value is None:
                value = torch.empty(mt.tensor.shape, dtype=mt.tensor.dtype, device=self.device)
            wrapped = (nn.Parameter(value, requires_grad=mt.tensor.requires_grad)
                       if slot.kind == "_parameters" else value)
            swapped.append((slot, slot.get(), wrapped, value, (id(mt.tensor), reaches)))
            slot.set(wrapped)
            bound[value.untyped_storage()._cdata] = (id(mt.tensor), reaches)
        watch = WriteWatch(bound, lambda key: self.meta_names.get(key, "a tensor on the meta device"))
        try:
            with torch.no_grad(), watch:
                event.fn(event.module)
        except ForeignWrite as err:
            raise MaterializeError(
                f"materializing the meta model: {event.describe()} writes {err.name!r} ({err.op}), "
                "which is not registered on that module. zero_fx builds one module's own tensors "
                "at a time, so an initialization that reaches into other modules (a parent "
                "initializing its children's weights, as HuggingFace GPT-2's _init_weights and "
                "nn.MultiheadAttention do) cannot run on a meta model. Pass zero_compile(init_fn=fn) "
                "with fn(module) initializing only module's own parameters and buffers, or build "
                "the model on a real device") from None
        finally:
            for slot, original, wrapped, value, label in swapped:
                self._adopt_replaced(event, slot, wrapped, value, label, watch)
                slot.set(original)
        for tid, reaches in watch.written:
            self.writes[tid].add((index, reaches))

    def _adopt_replaced(self, event: InitEvent, slot: Slot, wrapped, value, label, watch) -> None:
        """An event that registers a new tensor (``self.inv_freq = ...``) instead of writing
        the bound one: its values count as written."""
        now = slot.get()
        if now is wrapped or now is None:
            return
        if tuple(now.shape) != tuple(value.shape):
            raise MaterializeError(
                f"{event.describe()} replaces {slot.name!r} with a tensor of shape "
                f"{list(now.shape)}; the meta model's is {list(value.shape)}")
        with torch.no_grad():
            value.copy_(now.detach())
        watch.written.add(label)

    def _finish(self, mt: ModelTensor, value: torch.Tensor) -> None:
        writes = self.writes[id(mt.tensor)]
        if not any(reaches for _, reaches in writes):
            if mt.is_param:
                raise MaterializeError(_no_values(mt, self.events))
            self.unwritten.append(mt)
            return
        if (value.is_floating_point() or value.is_complex()) and bool(value.isnan().any()):
            missing = int(value.isnan().sum())
            raise MaterializeError(
                f"{mt.name!r} is only partly initialized on the meta model: {missing} of "
                f"{value.numel()} elements were never written by "
                f"{_writers(mt, writes, self.events)} (or were written as NaN); its initialization "
                "must write every element")
        self.put_full(mt, value)

    def _check_tie(self, mt: ModelTensor, writes) -> None:
        """A tied tensor that events wrote before the tie existed: the value is the tensor of
        the module the model kept when it tied them, which a meta model does not show."""
        before_tie = [i for i, reaches in writes if not reaches]
        after_tie = [i for i, reaches in writes if reaches and self.events[i].writes_tied]
        if not before_tie or after_tie or mt.slots[0].module is self.tie_owner:
            return
        raise MaterializeError(
            f"{mt.name!r} is tied to {', '.join(repr(n) for n in mt.names[1:])}, and before the "
            f"tie {_writers(mt, writes, self.events, with_throwaways=True)} each initialized a "
            "tensor of its own: which one the tied tensor is depends on the order the model tied "
            "them in, which a meta model does not show. Pass zero_compile(init_fn=fn) with "
            "fn(module) initializing it (as the model's own init after tying does)")


def _writes(event: InitEvent, slot: Slot, mt: ModelTensor) -> bool:
    """Whether ``event`` writing ``slot`` reaches ``mt`` itself (not a pre-tie throwaway)."""
    return event.writes_tied or slot is mt.slots[0]


def _writers(mt: ModelTensor, writes, events: list[InitEvent], with_throwaways=False) -> str:
    found = sorted({events[i].describe() for i, reaches in writes if reaches or with_throwaways})
    return " and ".join(found) if found else "nothing"


def _no_values(mt: ModelTensor, events: list[InitEvent]) -> str:
    module = mt.slots[0].module
    kind = type(module).__name__
    ran = sorted({e.what for e in events if e.module is module})
    why = (f"{' and '.join(ran)} did not write it" if ran else
           f"{kind} has no reset_parameters() and no init_fn ran on it")
    return (f"{'parameter' if mt.is_param else 'buffer'} {mt.name!r} of {kind} has no values on "
            f"the meta model: {why}. Pass zero_compile(init_fn=fn) with fn(module) initializing "
            f"it as {kind}.__init__ does, give {kind} a reset_parameters(), or build the model "
            "on a real device")


class _Generators:
    """The random generators an init on ``device`` draws from: the CPU's, and the device's."""

    def __init__(self, device: torch.device):
        self.cuda = device if device.type == "cuda" else None

    def get(self):
        return (torch.get_rng_state(),
                torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None)

    def set(self, state) -> None:
        torch.set_rng_state(state[0])
        if self.cuda is not None:
            torch.cuda.set_rng_state(state[1], self.cuda)
