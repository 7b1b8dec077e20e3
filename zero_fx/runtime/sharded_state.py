"""Each rank's share of the model: parameter shards, their gradients, and the optimizer on them."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from ..formatting import format_bytes
from ..passes.common.collective_code import gather_bucket
from ..passes.reduce_grads import reduction
from ..plan import ShardPlan
from ..plan.layout import plan_shard
from ..plan.tensor_parallel import local_tensor, set_values
from ..passes.common.host_copies import wait_for_host_copies
from .offload import to_host
from .optimizer import check_elementwise, rebind_to_shards
from .process_group import World

_c10d = torch.ops._c10d_functional
log = logging.getLogger("zero_fx")


class ShardedState:
    """The model and optimizer after sharding.

    ``shards[name]`` is what the optimizer steps on for parameter ``name``: in
    stages 1-3 a flat 1/N slice (the master, in the parameter's own dtype), in
    stage 0 (replicated, as in DDP) the model's own parameter, untouched, or
    under mixed precision a whole master copy of it (the model's parameter
    then holds the compute dtype; [Note: mixed precision] in precision.py).

    [Note: stages 1 and 2 keep whole parameters]
    As in DeepSpeed's ZeRO-1/2, every rank keeps the model's whole parameters:
    the graph reads them as they are, only the optimizer (and, in stage 2, the
    gradients) are sharded. After the optimizer has stepped on the shards,
    ``refresh_parameters`` all-gathers each updated shard into its parameter:
    the one all-gather of Ψ per step that these stages cost. The model stays
    usable outside the step (evaluation, ``state_dict``), and the peak is the
    table's row: whole parameters plus, at the end of a stage-1 backward, whole
    gradients. Gathering inside the next step's graph instead would free each
    parameter after its last backward use and blur stages 1 and 2 together.

    [Note: expert parallelism at stages 1 and 2]
    Under expert parallelism a rank runs only its own experts ([Note: expert parallelism]
    in zero_fx/plan/expert_parallel.py), so in stages 1-2 it keeps only those whole: the
    other ranks' experts are freed as in stage 3 (the graph never reads them), the update
    is gathered into this rank's experts over its expert-data-parallel group (the ranks
    holding the same experts), and whole values of every expert (``full_parameters``,
    checkpoints) come from the masters, as in stage 3. ``model.state_dict()`` is refused:
    it would hold empty tensors for the experts of other ranks.

    [Note: freed parameters]
    In stage 3 the model keeps its ``nn.Parameter`` objects, with their shapes
    and dtypes, but their storage is resized to zero bytes: dynamo still traces
    the model through them, while the values live in ``shards`` (one flat
    ``nn.Parameter`` per parameter, which the optimizer now steps on). Reading
    a freed parameter outside the compiled step fails; use
    ``full_parameters()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 plan: ShardPlan, world: World, *, elementwise_optimizer: Optional[bool] = None,
                 masters: Optional[dict[str, torch.Tensor]] = None,
                 device: Optional[torch.device] = None):
        if not plan.replicated:
            check_elementwise(optimizer, elementwise_optimizer)
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self.world = world
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self._name_of = {id(p): name for name, p in self.params.items()}
        self._check_optimizer_params()
        if not plan.replicated:
            self._check_optimizer_covers_trainable()
        self.shards: dict[str, torch.nn.Parameter] = {}
        self._received: dict[str, torch.Tensor] = {}
        self._unreduced: dict[str, torch.Tensor] = {}
        """Stages 0-1 with gradient accumulation: whole gradients summed over the calls
        since the last optimizer step, reduced by ``reduce_accumulated``."""
        self.gathered = False
        """Inside ``gathered_parameters()`` (stage 3): the model's parameters hold values."""
        self.device = device or next(local_tensor(p) for p in self.params.values()).device
        """Where this rank trains: the parameters', and every collective's, device."""
        self.device_shards: dict[str, torch.Tensor] = {}
        """Offloaded stage 3: each parameter's shard on the device (on the host with
        offload="parameters"), in the compute dtype, the graph's input; refreshed from the
        master after each optimizer step."""
        compute = plan.compute_dtype
        if self.shards_are_params:
            self.shards.update(self.params)
            return
        masters = masters or {}  # shards made while materializing a meta model (zero_fx.materialize)
        for name, param in self.params.items():
            master = masters.get(name)
            if master is None:
                master = (param.detach().clone() if plan.replicated
                          else plan_shard(plan, name, local_tensor(param)))
            if self.offloaded:
                if plan.params_sharded:  # the graph's input; on the host too when offloaded
                    shard = master.detach().to(self.device, dtype=compute or master.dtype, copy=True)
                    self.device_shards[name] = (to_host(shard, self.device)
                                                if plan.offloads_parameters else shard)
                master = to_host(master.detach(), self.device)
            self.shards[name] = torch.nn.Parameter(master, requires_grad=param.requires_grad)
        rebind_to_shards(
            optimizer,
            {param: self.shards[name] for name, param in self.params.items()},
            lambda param, tensor: (tensor.detach().clone() if plan.replicated else
                                   plan_shard(plan, self._name_of[id(param)],
                                              local_tensor(tensor))),
        )
        with torch.no_grad():
            for param in self.params.values():
                param.grad = None
                if plan.params_sharded:
                    if compute is not None:  # the values live in the shard: no copy
                        set_values(param, torch.empty_like(param, dtype=compute))
                    local_tensor(param).untyped_storage().resize_(0)
                elif compute is not None:
                    set_values(param, param.data.to(compute))
        if plan.params_sharded:
            model.register_forward_pre_hook(self._refuse_sharded_forward)
            model.register_state_dict_pre_hook(self._refuse_sharded_state_dict)
        elif plan.expert_parallel is not None:  # [Note: expert parallelism at stages 1 and 2]
            with torch.no_grad():
                for name in plan.expert_parallel.slices:
                    if not plan.holds(name):
                        local_tensor(self.params[name]).untyped_storage().resize_(0)
            model.register_state_dict_pre_hook(self._refuse_sharded_state_dict)
        for module in model.modules():
            if any(True for _ in module.parameters()):
                module._apply = RefuseConversion(module)

    @torch.no_grad()
    def move_to_host(self, plan: ShardPlan) -> None:
        """Re-place the state for ``plan``, which offloads more than the current plan
        (``offload="auto"``: [Note: choosing what to offload] in offload_choice.py). The
        masters (the same ``nn.Parameter`` objects, which the optimizer holds), their
        gradients and the optimizer's state go to the host. In stage 3 each shard the graph
        reads becomes a copy in the compute dtype, kept on the device, or on the host with
        offload="parameters"."""
        for name, shard in self.shards.items():
            if plan.params_sharded:
                kept = self.device_shards.get(name)
                if kept is None:
                    kept = shard.detach().to(self.device, dtype=plan.compute_dtype or shard.dtype,
                                             copy=True)
                self.device_shards[name] = (to_host(kept, self.device)
                                            if plan.offloads_parameters else kept)
            shard.data = to_host(shard.data, self.device)
            if shard.grad is not None:
                shard.grad = to_host(shard.grad, self.device)
            state = self.optimizer.state.get(shard, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = to_host(value, self.device)
        self.plan = plan

    @property
    def offloaded(self) -> bool:
        """The masters and the optimizer's state live in host memory ([Note: optimizer
        offload] in offload.py)."""
        return self.plan.offloads_optimizer

    @property
    def shards_are_params(self) -> bool:
        """Stage 0 without mixed precision: the optimizer steps on the model's own parameters."""
        return self.plan.replicated and self.plan.compute_dtype is None

    @property
    def masters_sharded(self) -> bool:
        """Whether the optimizer's values are only in shards, so that whole ones take a
        gather: stage 3, or stages 1-2 under mixed precision (the model's whole parameters
        then hold the compute dtype)."""
        return not self.plan.replicated and (self.plan.params_sharded
                                             or self.plan.compute_dtype is not None
                                             or self.plan.expert_parallel is not None)

    def _check_optimizer_params(self) -> None:
        foreign = [
            tuple(p.shape)
            for group in self.optimizer.param_groups
            for p in group["params"]
            if id(p) not in self._name_of
        ]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
                f"(shapes {foreign[:3]}{'...' if len(foreign) > 3 else ''}); zero_fx shards the "
                "model's parameters, so build the optimizer from model.parameters()"
            )

    def _check_optimizer_covers_trainable(self) -> None:
        """Stages 1-3 step on shards of what the optimizer holds; a trainable parameter it does
        not hold would have its gradient reduced every step and never applied."""
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in self.params.items() if p.requires_grad and id(p) not in held]
        if missing:
            raise ValueError(
                f"the optimizer holds {len(self.params) - len(missing)} of the model's parameters "
                f"but not {len(missing)} trainable one(s) ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); build it from model.parameters(), or set "
                f"requires_grad=False on the parameters you mean to freeze")

    def check_unchanged(self) -> None:
        """The model and optimizer still hold what was sharded (checked on every call)."""
        current = dict(self.model.named_parameters())
        if current.keys() != self.params.keys() or any(
                current[name] is not param for name, param in self.params.items()):
            added = sorted(current.keys() - self.params.keys())
            removed = sorted(self.params.keys() - current.keys())
            replaced = sorted(n for n in current.keys() & self.params.keys()
                              if current[n] is not self.params[n])
            what = "; ".join(f"{label} {names[:3]}" for label, names in
                             (("added", added), ("removed", removed), ("replaced", replaced)) if names)
            raise ValueError(
                f"the model's parameters changed after zero_compile sharded them ({what}); the plan "
                "and the shards are made on the first call, so finish building the model first: a "
                "changed model needs a new model object, optimizer and decorated step")
        known = {id(t) for t in self.shards.values()}
        if any(id(p) not in known for g in self.optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer gained parameters after zero_compile sharded it "
                             "(add_param_group?); give all parameter groups before the first call")

    def shard_names(self) -> dict[int, str]:
        """``{id(shard): parameter name}`` for the tensors the optimizer holds."""
        return {id(shard): name for name, shard in self.shards.items()}

    def local(self, name: str) -> torch.Tensor:
        """The model's parameter ``name`` as zero_fx shards it: its local piece for a
        tensor-parallel DTensor ([Note: ZeRO over tensor parallelism]), else itself."""
        return local_tensor(self.params[name])

    def param_name(self, tensor: torch.Tensor) -> Optional[str]:
        """The plan name of a model parameter, or None for any other tensor."""
        return self._name_of.get(id(tensor))

    def shard_input(self, name: str) -> torch.Tensor:
        """What the compiled graph reads for parameter ``name``, outside autograd: its shard
        in stage 3, the whole parameter otherwise."""
        if self.plan.params_sharded:
            return self.device_shards[name] if self.offloaded else self.shards[name].detach()
        return self.local(name).detach()

    def graph_inputs(self, param_names, args) -> list:
        """The compiled graph's inputs: shards where ``param_names`` names a parameter, else ``args``."""
        return [self.shard_input(n) if n else a for n, a in zip(param_names, args)]

    def receive_grad(self, name: str, grad_shard: torch.Tensor) -> None:
        """Hold a gradient the graph returned until ``commit_grads``.

        Not written to ``.grad`` at once: after the graph returns, dynamo sets
        each traced parameter's ``.grad`` to what the graph returned in its slot
        (None), and in stage 0 the shard *is* the traced parameter.
        """
        self._received[name] = grad_shard

    def commit_grads(self) -> None:
        """Add the received gradients, in the masters' dtype, to the shards' ``.grad`` (or,
        when the plan reduces outside the graph, to the whole gradients awaiting it)."""
        into = self._unreduced if not self.plan.reduces_in_graph else None
        for name, grad in self._received.items():
            shard = self.shards[name]
            # whole gradients awaiting their reduction stay on the device; shards go to the
            # masters (the host, offloaded: [Note: optimizer offload])
            grad = grad.to(dtype=shard.dtype, device=shard.device if into is None else None)
            if into is not None:
                into[name] = grad if name not in into else into[name] + grad
            else:
                shard.grad = grad if shard.grad is None else shard.grad + grad
        self._received.clear()

    @torch.no_grad()
    def reduce_accumulated(self) -> None:
        """Stages 0-1 with gradient accumulation: reduce the accumulated whole gradients, one
        collective per bucket (the code the graph would have run), into the shards' ``.grad``.
        A no-op when the graph reduces."""
        if not self._unreduced:
            return
        names = [layout.name for layout in self.plan.params if layout.name in self._unreduced]
        for bucket in self.plan.buckets(names):
            reduced = reduction(self.plan, bucket)(*(self._unreduced[name] for name in bucket))
            wait_for_host_copies()  # offloaded: the shards were streamed to the host
            for name, grad in zip(bucket, reduced):
                shard = self.shards[name]
                shard.grad = grad.to(dtype=shard.dtype, device=shard.device)
        self._unreduced.clear()

    def grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer will step with (this rank's shards of them)."""
        return [s.grad for s in self.shards.values() if s.grad is not None]

    @torch.no_grad()
    def refresh_parameters(self, frozen: bool = False, fresh: frozenset = frozenset()) -> None:
        """Copy the updated masters into the model's parameters.

        Stage 0 with mixed precision: a cast copy of each master. Stages 1-2:
        all-gather the updated shards (cast to the compute dtype) into the whole
        parameters, one collective per bucket (``plan.buckets``, in plan order);
        frozen parameters never change and are skipped unless ``frozen`` (after
        loading a checkpoint). A no-op in stage 0
        without mixed precision (the optimizer stepped on the parameters) and in
        stage 3 (the next step gathers where it uses them). ``fresh``: offloaded stage 3,
        the shards the update already wrote on the device ([Note: the update streamed
        through the device] in streamed_update.py).
        """
        if self.plan.params_sharded and self.offloaded:  # [Note: optimizer offload]
            for name, device_shard in self.device_shards.items():
                if name not in fresh and (frozen or self.shards[name].requires_grad):
                    device_shard.copy_(self.shards[name].detach(), non_blocking=True)
            return
        if self.plan.params_sharded or self.shards_are_params:
            return
        if self.plan.replicated:
            for name, param in self.params.items():
                param.copy_(self.shards[name])
            return
        self._gather_into_parameters(
            [layout.name for layout in self.plan.params if frozen or layout.requires_grad])

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None
        self._unreduced.clear()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter as the optimizer holds it (fp32 masters under mixed
        precision); in stages 1-3 gathered from all ranks where the model's own parameters
        are not that (a collective: call it on every rank)."""
        if self.plan.replicated:
            return {name: shard.detach().clone() for name, shard in self.shards.items()}
        if not self.masters_sharded:
            return {name: self._whole(name, self.local(name).detach().clone())
                    for name in self.params}
        return {name: self._whole(name, self._gather([name], [shard.detach()])[0].clone())
                for name, shard in self.shards.items()}

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s whole value from its whole local piece: under tensor
        parallelism a collective over "tp" for a split one, else ``local`` itself."""
        parallel = self.plan.tensor_parallel
        return parallel.whole(name, local) if parallel is not None else local

    @torch.no_grad()
    def stream_full_parameters(self, keep: bool, dtype: Optional[torch.dtype] = None,
                               to: Optional[torch.device] = None
                               ) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """``(name, whole value)`` for every parameter as the optimizer holds it (fp32
        masters under mixed precision), in plan order, holding at most one bucket of them
        whole on the device at a time ([Note: streaming whole parameters]).

        ``keep``: whether this rank wants the values; a rank that does not gets ``None``
        for each (it still takes part in the gathers it is needed for). ``dtype``: cast
        floating-point values (before the gather, so the collective moves that dtype).
        ``to``: where the kept values go (a fresh copy there; None: this rank's device).
        Sharded masters are gathered one bucket at a time (``plan.buckets``): a
        collective over the shard group, so every rank of it must run the generator to its
        end; whole ones (stage 0, or stages 1-2 without mixed precision) are copied one
        at a time and need no other rank.

        [Note: streaming whole parameters]
        The dict of every whole parameter is the model: on the device it is exactly
        what stage 3 exists to avoid. Streamed, the device holds the shards it always
        holds plus two buffers made once for the largest bucket and reused by every
        bucket: its shards cast and packed (1/N of the bucket) and the gathered
        bucket; each parameter is copied from its column of the gathered buffer
        straight into a fresh tensor on ``to``. So the extra device memory is one
        bucket times (1 + 1/N), whatever the allocator or the backend does with
        tensors a collective has released (gloo's worker thread drops its reference
        to a finished all-gather's tensors a moment after the wait returns: a fresh
        buffer per bucket measured two buckets alive at times). Where a column is
        strided (several parameters in a bucket) the copy to another device may
        make one contiguous temporary of that parameter. The copy to the host is
        synchronous (pageable memory): a pinned, double-buffered copy would overlap
        the next gather with it, at the price of a second bucket.
        """
        if self.plan.tensor_parallel is not None:
            # every rank takes part in making each split parameter whole over "tp"
            for name, local in self._stream_local(True, dtype, None):
                whole = self._whole(name, local)  # on every rank, kept or not
                yield name, _copied(whole, None, to) if keep else None
            return
        yield from self._stream_local(keep, dtype, to)

    def _stream_local(self, keep: bool, dtype: Optional[torch.dtype],
                      to: Optional[torch.device]) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        """``stream_full_parameters`` of the local pieces ([Note: ZeRO over tensor
        parallelism]): whole over the shard group."""
        if not self.masters_sharded:
            for layout in self.plan.params:
                source = (self.shards[layout.name] if self.plan.replicated
                          else self.local(layout.name))
                yield layout.name, (_copied(source.detach(), dtype, to) if keep else None)
            return
        size = self.world.size
        buckets = [[self.plan.layout(name) for name in bucket]
                   for bucket in self.plan.buckets([layout.name for layout in self.plan.params])]
        dtypes = [_cast_dtype(layouts[0].dtype, dtype) for layouts in buckets]
        most = max(sum(l.shard_numel for l in layouts) * d.itemsize
                   for layouts, d in zip(buckets, dtypes))
        send_bytes = torch.empty(most, dtype=torch.uint8, device=self.device)
        gathered_bytes = torch.empty(most * size, dtype=torch.uint8, device=self.device)
        for layouts, gathered_dtype in zip(buckets, dtypes):
            if self.plan.is_expert(layouts[0].name):  # [Note: expert parallelism]
                for layout in layouts:
                    whole = self._gather_expert(layout.name, self.shards[layout.name].detach(),
                                                gathered_dtype)
                    yield layout.name, _copied(whole, None, to) if keep else None
                continue
            numel = sum(l.shard_numel for l in layouts)
            send = send_bytes[:numel * gathered_dtype.itemsize].view(gathered_dtype)
            for piece, layout in zip(send.split([l.shard_numel for l in layouts]), layouts):
                piece.copy_(self.shards[layout.name].detach())  # casts as it copies
            gathered = gathered_bytes[:numel * size * gathered_dtype.itemsize].view(gathered_dtype)
            if size > 1:
                _c10d.wait_tensor(_c10d.all_gather_into_tensor_out(
                    send, size, self.world.group_name, out=gathered))
            else:
                gathered = send
            columns = gathered.view(size, -1).split([l.shard_numel for l in layouts], dim=1)
            for layout, column in zip(layouts, columns):
                yield layout.name, (_column_copy(column, layout, to) if keep else None)

    def gathered_bytes(self) -> int:
        """What ``gathered_parameters()`` allocates on this rank: every parameter whole, in
        the compute dtype (0 in stages 0-2, whose parameters are always whole)."""
        if not self.plan.params_sharded:
            return 0
        return sum(layout.numel * self.plan.gather_dtype(layout).itemsize
                   for layout in self.plan.params)

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Stage 3: fill the model's parameters with their full values (in the compute dtype)
        for the duration; free them again after. Changes made to them are discarded. A no-op
        in stages 0-2, whose parameters are always whole. A collective: enter on every rank."""
        if not self.plan.params_sharded or self.gathered:
            yield
            return
        log.info("zero_fx: gathered_parameters: rank %d gathers %s (every parameter whole, in "
                 "%s) on %s for the block; for the values alone, full_state_dict(cpu_offload="
                 "True) holds one bucket at a time", self.world.global_rank,
                 format_bytes(self.gathered_bytes()),
                 ", ".join(sorted({str(self.plan.gather_dtype(layout)).removeprefix("torch.")
                                   for layout in self.plan.params})),
                 self.device)
        with torch.no_grad():
            self._gather_into_parameters([layout.name for layout in self.plan.params])
        self.gathered = True
        try:
            yield
        finally:
            self.gathered = False
            for name in self.params:
                self.local(name).untyped_storage().resize_(0)

    def _refuse_sharded_forward(self, module, args) -> None:
        """Stage 3: the model's parameters have no storage outside the compiled step."""
        if torch.compiler.is_compiling() or self.gathered:
            return
        raise RuntimeError(
            f"the model's parameters are sharded over {self.plan.world_size} rank(s) by its "
            "@zero_compile step (stage 3) and hold no values outside it. To run the model "
            "(evaluation, generation), call it inside a function decorated with @zero_compile "
            "that takes the model and no optimizer (it gathers block by block), or enter `with "
            "train_step.gathered_parameters():` on every rank (the whole model); for the "
            "values, call train_step.full_parameters()")

    def _refuse_sharded_state_dict(self, module, prefix, keep_vars) -> None:
        if self.gathered or torch.compiler.is_compiling():
            return
        if not self.plan.params_sharded:  # [Note: expert parallelism at stages 1 and 2]
            raise RuntimeError(
                f"with expert_parallel={self.plan.expert_parallel.degree} each rank keeps only "
                "its own experts whole, so model.state_dict() would save empty tensors for the "
                "others; use train_step.full_state_dict() (on every rank) for every parameter "
                "whole, or train_step.save_checkpoint(path)")
        raise RuntimeError(
            "the model's parameters are sharded by its @zero_compile step (stage 3) and hold no "
            "values, so model.state_dict() would save empty tensors; take it inside `with "
            "train_step.gathered_parameters():` (on every rank), or use "
            "train_step.full_parameters()")

    def _gather_into_parameters(self, names: list[str]) -> None:
        """All-gather the masters of ``names`` (cast to the compute dtype) into the model's
        parameters, one collective per bucket in plan order; a freed (stage 3) parameter gets
        its storage back first."""
        for bucket in self.plan.buckets(names):
            if self.plan.is_expert(bucket[0]) and (not self.plan.params_sharded
                                                   or self.plan.is_expert_rows(bucket[0])):
                bucket = [name for name in bucket if self.plan.holds(name)]
                if not bucket:
                    continue
                fulls = self._gather_over_group(  # [Note: expert parallelism at stages 1 and 2]
                    bucket, [self.shards[name].detach() for name in bucket], self.plan.compute_dtype)
            else:
                fulls = self._gather(bucket, [self.shards[name].detach() for name in bucket],
                                     dtype=self.plan.compute_dtype)
            for name, full in zip(bucket, fulls):
                param = self.local(name)
                if param.untyped_storage().nbytes() == 0:
                    param.untyped_storage().resize_(param.numel() * param.element_size())
                param.copy_(full)

    def _gather(self, names: list[str], shards: list[torch.Tensor],
                dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        if self.plan.is_expert(names[0]):  # a bucket holds experts only, or none
            return [self._gather_expert(name, shard, dtype) for name, shard in zip(names, shards)]
        return self._gather_over_group(names, shards, dtype)

    def _gather_over_group(self, names: list[str], shards: list[torch.Tensor],
                           dtype: Optional[torch.dtype]) -> list[torch.Tensor]:
        """``names`` whole, gathered over the ranks that shard them (``plan.collective_group``:
        the shard group, or a routed expert's holders)."""
        layouts = [self.plan.layout(name) for name in names]
        size, group = self.plan.collective_group(names[0])
        shards = [shard.to(self.device) for shard in shards]  # offloaded masters: a device copy
        return gather_bucket(*shards, numels=[l.numel for l in layouts],
                             shapes=[l.shape for l in layouts], world_size=size,
                             group_name=group, dtype=dtype)

    def _gather_expert(self, name: str, shard: torch.Tensor,
                       dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A routed expert's whole value on every rank, under expert parallelism: its shards
        live on the ranks of one expert-data-parallel group only, so every rank puts in a
        buffer of a shard's size (the holders their shard, the others zeros), gathered over
        all ranks, and the holders' rows make the value. For whole values (checkpoints,
        ``full_parameters``), not the step: it moves the expert ``P`` times over."""
        layout, parallel = self.plan.layout(name), self.plan.expert_parallel
        mine = (shard.to(self.device) if self.plan.holds(name)
                else shard.new_zeros(layout.shard_numel, device=self.device))
        mine = mine.to(dtype) if dtype is not None and mine.dtype.is_floating_point else mine
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(
            mine.contiguous(), self.plan.world_size, self.plan.group_name))
        if self.plan.is_expert_rows(name):
            # [Note: experts held as 3-D parameters, split by rows]: rank g holds shard g // P
            # of place g % P's rows; the places' rows one after the other make the whole
            places = gathered.view(parallel.data_size, parallel.degree, -1).transpose(0, 1)
            rows = places.reshape(parallel.degree, -1)[:, :layout.numel]
            return rows.reshape(self.plan.whole_shape(name))
        rows = gathered.view(self.plan.world_size, -1)[parallel.slices[name]::parallel.degree]
        return rows.reshape(-1)[:layout.numel].view(layout.shape)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank holds for the model: shards, their grads, optimizer state,
        and the model's parameters (freed in stage 3); each once."""
        seen = set()
        for tensor in self._all_held():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor

    def _all_held(self) -> Iterator[torch.Tensor]:
        yield from (self.local(name) for name in self.params)
        yield from self.device_shards.values()
        for shard in self.shards.values():
            yield shard
            if shard.grad is not None:
                yield shard.grad
        yield from self._unreduced.values()
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _cast_dtype(own: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype`` for a floating-point ``own``, else ``own`` (integers are not cast)."""
    return dtype if dtype is not None and own.is_floating_point else own


def _copied(tensor: torch.Tensor, dtype: Optional[torch.dtype],
            to: Optional[torch.device]) -> torch.Tensor:
    """A fresh copy of ``tensor`` on ``to`` (None: where it is), cast as ``_cast_dtype`` says; the
    cast happens in the copy, with no temporary on the source device."""
    out = torch.empty(tensor.shape, dtype=_cast_dtype(tensor.dtype, dtype),
                      device=to if to is not None else tensor.device)
    return out.copy_(tensor)


def _column_copy(column: torch.Tensor, layout, to: Optional[torch.device]) -> torch.Tensor:
    """Parameter ``layout``'s whole value, copied to ``to`` from its column ``(world size,
    shard numel)`` of a gathered bucket (rank-major, padded: [Note: flat layout])."""
    out = torch.empty(column.shape, dtype=column.dtype,
                      device=to if to is not None else column.device)
    out.copy_(column)
    return out.view(-1)[:layout.numel].view(layout.shape)


class RefuseConversion:
    """Each module's ``_apply`` once zero_fx has sharded the model: ``model.to(dtype or
    device)``, ``.half()``, ``.cuda()`` would change the parameters under the plan and the
    shards (the fp32 masters, made on the first call); in stage 3, whose parameters have no
    storage, the copy reads freed memory (a SIGSEGV); ``to_empty()`` would give them new,
    uninitialized storage. What returns each tensor itself (``.to("cpu")`` on CPU,
    ``.float()`` of fp32, ``share_memory()``) goes through."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, fn, recurse: bool = True):
        kinds = {(p.dtype, p.device) for p in self.module.parameters()}
        for dtype, device in kinds:
            probe = torch.empty(0, dtype=dtype, device=device)
            converted = fn(probe)
            if converted is not probe:
                change = (f"turn the model's {dtype} parameters on {device} into "
                          f"{converted.dtype} on {converted.device}"
                          if (converted.dtype, converted.device) != (dtype, device)
                          else "replace the model's parameters with new tensors (to_empty?)")
                raise ValueError(
                    f"this would {change}, after its @zero_compile step sharded them (the plan "
                    "and the fp32 master shards are made on the first call): move and cast the "
                    "model before the first call; for 16-bit compute, zero_compile(mixed_precision="
                    "MixedPrecision(param_dtype=torch.bfloat16)) keeps fp32 masters")
        return type(self.module)._apply(self.module, fn, recurse)
