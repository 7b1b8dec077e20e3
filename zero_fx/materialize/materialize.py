"""Give a model its values as it is sharded: from its construction replayed (a meta model) or from
pretrained weights, keeping only what this rank holds."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional, Protocol

import torch
import torch.nn as nn

from ..plan import ShardPlan
from ..plan.layout import plan_shard
from . import hf
from .events import construction_events
from .model_tensors import ModelTensor, model_tensors, own_slots
from .replay import MaterializeError, replay


class WeightSource(Protocol):
    """Where ``materialize`` reads values instead of initializing (``PretrainedWeights`` in
    pretrained.py, which builds on this module, so it is named here by what it does)."""

    key_of: dict[int, str]
    """id(tensor) -> the key holding its values: the tensors it gives."""

    def read_into(self, tensors: list[ModelTensor], sink) -> None:
        """Read every tensor it gives into ``sink``."""

log = logging.getLogger("zero_fx")

HOST = torch.device("cpu")
"""Where initialization runs ([Note: built on the host])."""


def materialize(model: nn.Module, plan: ShardPlan, *,
                init_fn: Optional[Callable[[nn.Module], None]] = None,
                pretrained: Optional[WeightSource] = None,
                device: Optional[torch.device] = None) -> Optional[dict[str, torch.Tensor]]:
    """Give ``model``'s meta tensors values, and with ``pretrained`` every tensor the files
    hold, keeping only what this rank holds: in stage 3 each parameter's shard (returned,
    by plan name; the parameter keeps its shape with no storage), in stages 0-2 whole
    parameters; buffers whole. Meta tensors not in the files are initialized as the
    model's construction would ([Note: replaying construction] in events.py), one
    module at a time. Meta tensors change only once everything succeeded (swapped in
    place: the modules, ties and the optimizer keep referring to the same objects);
    tensors that have values are overwritten as they are read. New tensors go on
    ``device``, by default the CPU (the first call passes where this rank trains); values
    are built on the host ([Note: built on the host]).

    Returns the stage-3 shards, or None when the caller cuts them from whole parameters
    (stages 0-2, or nothing to materialize)."""
    tensors = model_tensors(model)
    meta = [mt for mt in tensors if mt.is_meta]
    if not meta and pretrained is None:
        if init_fn is not None:
            log.warning("zero_fx: init_fn is for models built on the meta device; this model "
                        "already has values, so init_fn did not run")
        return None
    device = device if device is not None else torch.device("cpu")
    sink = _Sink(plan, device)
    in_files = pretrained.key_of if pretrained is not None else {}
    wanted = [mt for mt in meta if id(mt.tensor) not in in_files]
    if wanted:  # first: what it allocates on the way is gone before the shards fill up
        _initialize(model, tensors, wanted, sink, HOST, init_fn, loading=pretrained is not None)
    if pretrained is not None:
        pretrained.read_into(tensors, sink)
    sink.install(tensors)
    if meta:
        log.info("zero_fx: materialized %d tensor(s) of the meta model on %s (%s)", len(meta),
                 device, "from pretrained weights" if pretrained is not None and not wanted else
                 "initialized as its construction would" if pretrained is None else
                 f"{len(meta) - len(wanted)} from pretrained weights, {len(wanted)} initialized")
    return sink.masters if plan.params_sharded else None


def _initialize(model, tensors, wanted, sink, device, init_fn, *, loading: bool) -> None:
    """Build ``wanted`` on ``device`` (the host) and hand each to ``sink``.

    [Note: built on the host]
    Initialization runs on the CPU, whatever device the rank trains on, and only
    what the rank keeps is copied to its device: a stage-3 parameter's shard, cut
    on the host, or a whole tensor (stages 0-2, buffers). Built on the device, every
    tensor (the embedding, a large projection) would sit there whole, however
    briefly, next to the shards made so far: on the models stage 3 is for, the
    largest parameter alone may not fit. Host memory holds one module's tensors
    at a time ([Note: building one module at a time] in replay.py).

    The random numbers come from the CPU generator, so the values are those of the
    model built on the CPU under the same seed and then moved (``Model(cfg).to(device)``,
    the usual script), not those of one built under ``with torch.device("cuda")``,
    which draws from the GPU's generator; the GPU's generator is left as it is.
    Initializing on the CPU is slower than on a GPU (each rank draws the whole model,
    one module at a time); the pretrained path (``load_pretrained``) reads only
    this rank's rows and draws nothing.
    """
    uses_hf_init = init_fn is None and hf.is_pretrained_model(model)
    if loading and hf.is_pretrained_model(model):
        unwritten = wanted  # what the files lack are buffers its __init__ computes: rebuilt below
    else:
        events = construction_events(model, init_fn)
        if loading:  # the random stream does not matter: only the events that write what is missing
            by_id = {id(mt.tensor): mt for mt in tensors}
            wanted_ids = {id(mt.tensor) for mt in wanted}
            events = [e for e in events
                      if any(id(mt.tensor) in wanted_ids for _, mt in own_slots(e.module, by_id))]
        with torch.random.fork_rng(devices=[]) if loading else contextlib.nullcontext():
            unwritten = replay(tensors, wanted, events, device, sink.put_full,
                               tie_owner=model.get_input_embeddings() if uses_hf_init else None)
    if not unwritten:
        return
    computed = (hf.computed_buffers(model, [mt.name for mt in unwritten], device)
                if hf.is_pretrained_model(model) else {})
    for mt in unwritten:
        if mt.name not in computed:
            raise MaterializeError(
                f"buffer {mt.name!r} of {type(mt.slots[0].module).__name__} has no values on the "
                "meta model: its module computes it in __init__, which ran on the meta device, "
                "and no reset_parameters() or init_fn wrote it. Pass zero_compile(init_fn=fn) "
                "with fn(module) computing it, or build the model on a real device")
        sink.put_full(mt, computed[mt.name].to(mt.tensor.dtype))


class _Sink:
    """Where materialized values go: this rank's shards (stage-3 parameters) or whole
    tensors, held until ``install`` puts them into the model all at once."""

    def __init__(self, plan: ShardPlan, device: torch.device):
        self.plan = plan
        self.device = device
        self.masters: dict[str, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def sharded(self, mt: ModelTensor) -> bool:
        return mt.is_param and self.plan.params_sharded

    def put_full(self, mt: ModelTensor, full: torch.Tensor) -> None:
        """``full``: the tensor's whole value, on any device (this call may free it); what
        this rank keeps of it goes to ``self.device``."""
        if self.sharded(mt):
            shard = plan_shard(self.plan, mt.name, full)
            self.masters[mt.name] = shard.to(self.device)
            _free(full)
            if mt.is_meta:  # the parameter keeps its shape, not its values
                self._values[id(mt.tensor)] = storageless(mt.tensor, self.device)
            return
        value = full.to(self.device)
        if value is not full:
            _free(full)
        if mt.is_meta:
            self._values[id(mt.tensor)] = value
        else:
            with torch.no_grad():
                mt.tensor.copy_(value)

    def put_shard(self, mt: ModelTensor, fill: Callable[[torch.Tensor, int, int], None]) -> None:
        """A stage-3 parameter's shard, filled directly by ``fill(out, start, stop)`` with its
        flat elements ``[start, stop)`` (the padding stays zero)."""
        if mt.is_meta:
            self._values[id(mt.tensor)] = storageless(mt.tensor, self.device)
        layout = self.plan.layout(mt.name)
        if not self.plan.holds(mt.name):  # a routed expert another rank holds
            self.masters[mt.name] = torch.zeros(0, dtype=layout.dtype, device=self.device)
            return
        start, stop = layout.owned_range(self.plan.shard_rank(mt.name))
        shard = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=self.device)
        fill(shard[: stop - start], start, stop)
        self.masters[mt.name] = shard

    def install(self, tensors: list[ModelTensor]) -> None:
        """Swap each meta tensor's contents for its value (``torch.utils.swap_tensors``: the
        Python object stays, so the modules, ties and the optimizer keep referring to it)."""
        for mt in tensors:
            value = self._values.get(id(mt.tensor))
            if value is None:
                continue
            if mt.is_param:
                value = nn.Parameter(value, requires_grad=mt.tensor.requires_grad)
            value.__dict__.update(mt.tensor.__dict__)
            torch.utils.swap_tensors(mt.tensor, value)
        self._values.clear()


def storageless(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``like``'s shape and dtype on ``device`` holding no memory: a
    stage-3 parameter ([Note: freed parameters] in runtime/sharded_state.py).

    [Note: a sized tensor without storage]
    PyTorch cannot make a tensor of a shape on a device without giving it that much
    storage first (``set_`` grows the storage to fit, ``as_strided`` refuses a
    storage too small), so the bytes are allocated, never written, and released
    at once. On CUDA the caching allocator keeps the block for what comes next (the
    next shards are cut from it), so materializing reserves the largest parameter
    once beside the shards, never the model; on the host, pages never written are
    never committed."""
    tensor = torch.empty(like.shape, dtype=like.dtype, device=device)
    tensor.untyped_storage().resize_(0)
    return tensor


def _free(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory now, though the replay may still refer to it."""
    tensor.untyped_storage().resize_(0)
