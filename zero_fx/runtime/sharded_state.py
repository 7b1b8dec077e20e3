"""Each rank's share of the model: parameter shards, their gradients, and the optimizer on them."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..passes.reduce_grads import reduction
from ..plan import ShardPlan
from ..plan.layout import plan_shard
from ..plan.tensor_parallel import local_tensor, set_values
from ..passes.common.host_copies import wait_for_host_copies
from .offload import to_host
from .optimizer import check_shapes, rebind_to_shards
from .update.optimizer_set import members
from .distributed.process_group import World
from .refuse_conversion import RefuseConversion
from .whole_parameters import WholeParameters
from .update.whole_tensor_updates import WholeTensorUpdates


class ShardedState(WholeParameters):
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
                 plan: ShardPlan, world: World, *,
                 masters: Optional[dict[str, torch.Tensor]] = None,
                 device: Optional[torch.device] = None):
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self.world = world
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self._name_of = {id(p): name for name, p in self.params.items()}
        self._check_optimizer_params()
        for member in members(optimizer):
            check_shapes(member, self._name_of)
        self.updates: tuple = ()
        """Each parameter's update rule and where it runs (``ParameterUpdate``s, set by
        ``shard``; ``explain()`` lists them)."""
        self.whole: Optional[WholeTensorUpdates] = None
        """The whole tensors of the updates that need them, on their owners ([Note: whole-tensor
        updates on owner ranks] in whole_tensor_updates.py); None when every update is flat."""
        if not plan.replicated:
            self._check_optimizer_covers_trainable()
        self.shards: dict[str, torch.nn.Parameter] = {}
        self._received: dict[str, torch.Tensor] = {}
        self._unreduced: dict[str, torch.Tensor] = {}
        """Stages 0-1 with gradient accumulation: whole gradients summed over the calls
        since the last optimizer step, reduced by ``reduce_accumulated``."""
        self.gathered = False
        """Inside ``gathered_parameters()`` (stage 3): the model's parameters hold values."""
        self.stepped: set[str] = set()
        """The parameters the latest update stepped: those whose shard had a gradient. Only
        these changed, so only these are refreshed ([Note: what the update refreshes])."""
        self.grads_seen: set[str] = set()
        """The parameters whose ``.grad`` eager would hold as a tensor: given a gradient since
        the last ``zero_grad()`` that set gradients to None ([Note:
        zero_grad(set_to_none=False)] in runtime/update/update.py)."""
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
        if plan.owners:
            self.whole = WholeTensorUpdates(plan, self.shards, self.device)
        whole = self.whole.tensors if self.whole is not None else {}
        for member in members(optimizer):
            self._rebind(member, whole)
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

    def _rebind(self, optimizer: torch.optim.Optimizer, whole: dict) -> None:
        """Make ``optimizer`` step what zero_fx keeps for each of its parameters: its flat
        shard, or the whole tensor of an update its owner runs (``whole``)."""
        plan = self.plan
        rebind_to_shards(
            optimizer,
            {param: whole.get(name, self.shards[name]) for name, param in self.params.items()},
            lambda param, tensor: (tensor.detach().clone()
                                   if plan.replicated or self._name_of[id(param)] in whole else
                                   plan_shard(plan, self._name_of[id(param)],
                                              local_tensor(tensor))),
            stateless=frozenset(param for name, param in self.params.items()
                                if name in whole and not self.whole.owns(name)),
        )

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
        known = {id(t) for t in self.shards.values()} | {
            id(t) for t in (self.whole.tensors.values() if self.whole is not None else ())}
        if any(id(p) not in known for g in self.optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer gained parameters after zero_compile sharded it "
                             "(add_param_group?); give all parameter groups before the first call")

    def shard_names(self) -> dict[int, str]:
        """``{id(shard): parameter name}`` for the tensors the optimizer holds (a whole-tensor
        update's tensor, on its owner or empty elsewhere, and the flat shards)."""
        names = {id(shard): name for name, shard in self.shards.items()}
        if self.whole is not None:
            names.update({id(t): name for name, t in self.whole.tensors.items()})
        return names

    def steps_here(self, tensor: torch.Tensor) -> bool:
        """Whether this rank steps ``tensor`` of the optimizer's groups: all but the empty
        stand-ins of whole-tensor updates other ranks own."""
        return self.whole is None or all(
            tensor is not t or self.whole.owns(n) for n, t in self.whole.tensors.items())

    def optimizer_state_as_shards(self, loading: bool = False):
        """Inside, the optimizer's state is that of flat shards for every parameter
        (``WholeTensorUpdates.state_in_shard_form``); a no-op when every update is flat."""
        if self.whole is None:
            return contextlib.nullcontext()
        return _both(self.whole.shards_flat(self.shards),
                     self.whole.state_in_shard_form(members(self.optimizer), self.shards, loading))

    def shards_flat(self):
        """Inside, every shard holds its flat slice, those stored as owners' rows too
        (``WholeTensorUpdates.shards_flat``): a collective where any is; enter on every rank."""
        return contextlib.nullcontext() if self.whole is None else self.whole.shards_flat(self.shards)

    def before_step(self) -> list[str]:
        """Right before the optimizer steps after the graph: the gradients of whole-tensor
        updates sent to their owners; returns their names ([Note: whole-tensor updates on owner
        ranks])."""
        return self.whole.send_grads(self.shards) if self.whole is not None else []

    def after_step(self, exchanged: list[str]) -> None:
        """Right after it: each rank's shard of each whole tensor the owners stepped, into its
        master."""
        if self.whole is not None:
            self.whole.return_values(self.shards, exchanged, self.local)
            # their masters changed; where they did not come back whole, the stage's gather
            # brings them into the parameters, as for any stepped shard
            self.stepped |= set(exchanged) - self.whole.returned

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
        for name, grad in self._received.items():
            shard = self.shards[name]
            self.grads_seen.add(name)
            if self.plan.reduced_to_owner_in_graph(name):  # whole on its owner already
                self.whole.receive(name, grad)
                continue
            into = (self._unreduced if not self.plan.reduces_in_graph
                    or self.plan.reduced_by_owner(name) else None)
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
        """Reduce the whole gradients the graph left unreduced: with gradient accumulation at
        stages 0-1, one collective per bucket (the code the graph would have run) into the
        shards' ``.grad``; at stage 1, a whole-tensor update's gradients to their owners
        ([Note: reductions laid out by owner] in whole_tensor_updates.py). A no-op when the
        graph reduced every gradient."""
        if not self._unreduced:
            return
        if self.whole is not None and self.plan.reduces_to_owners:
            self.whole.reduce_to_owners({n: self._unreduced.pop(n) for n in self.whole.names
                                         if n in self._unreduced})
        names = [layout.name for layout in self.plan.params if layout.name in self._unreduced]
        for bucket in self.plan.buckets(names):
            reduced = reduction(self.plan, bucket)(*(self._unreduced[name] for name in bucket))
            wait_for_host_copies()  # offloaded: the shards were streamed to the host
            for name, grad in zip(bucket, reduced):
                shard = self.shards[name]
                shard.grad = grad.to(dtype=shard.dtype, device=shard.device)
        self._unreduced.clear()

    def grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer will step with: this rank's shards of them, and the
        whole gradients of the tensors it owns that reached it by their reduction."""
        owned = self.whole.reduced_grads() if self.whole is not None else []
        return [s.grad for s in self.shards.values() if s.grad is not None] + owned

    def note_stepped(self) -> None:
        """Before the optimizer steps after the graph: the shards it will change are those
        with a gradient ([Note: what the update refreshes])."""
        self.stepped = {name for name, shard in self.shards.items() if shard.grad is not None}

    def keep_zero_grads(self) -> None:
        """Before the optimizer steps: a parameter eager would hold a ``.grad`` for (zeroed,
        not None) but that this window gave none steps with a zero gradient, as in eager
        ([Note: zero_grad(set_to_none=False)] in runtime/update/update.py)."""
        for name in self.grads_seen:
            shard = self.shards[name]
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)

    @torch.no_grad()
    def refresh_parameters(self, frozen: bool = False, fresh: frozenset = frozenset()) -> None:
        """Copy the updated masters into the model's parameters.

        [Note: what the update refreshes]
        torch.optim skips a parameter whose ``.grad`` is None, so an update changes exactly
        the shards that held a gradient when it ran (``stepped``). Those are refreshed, and
        no others: which parameters those are is read at each update, never fixed at the
        first call, so a parameter frozen or unfrozen between calls (``requires_grad``
        toggled, ``model.requires_grad_(True)`` after training some layers frozen) is
        refreshed exactly when the optimizer moved it.

        Stage 0 with mixed precision: a cast copy of each master. Stages 1-2:
        all-gather the updated shards (cast to the compute dtype) into the whole
        parameters, one collective per bucket (``plan.buckets``, in plan order); every
        parameter when ``frozen`` (after loading a checkpoint). A no-op in stage 0
        without mixed precision (the optimizer stepped on the parameters) and in
        stage 3 (the next step gathers where it uses them). ``fresh``: offloaded stage 3,
        the shards the update already wrote on the device ([Note: the update streamed
        through the device] in streamed_update.py).
        """
        if self.plan.params_sharded and self.offloaded:  # [Note: optimizer offload]
            for name, device_shard in self.device_shards.items():
                if name not in fresh and (frozen or name in self.stepped):
                    device_shard.copy_(self.shards[name].detach(), non_blocking=True)
            return
        if self.plan.params_sharded or self.shards_are_params:
            return
        if self.plan.replicated:
            for name, param in self.params.items():
                if frozen or name in self.stepped:
                    param.copy_(self.shards[name])
            return
        # the same names on every rank: the graph, the same on each, gave each rank's shards
        # gradients for the same parameters (a rank's routed experts, which other ranks do
        # not hold, are gathered by their holders alone: kept in as the plan has them)
        # whole-tensor updates came back whole, into the parameters (returns_owners_whole)
        # so did the groups whose shards hold their owners' rows, at stages 1-2 under mixed
        # precision; a load gathers every shard, inside optimizer_state_as_shards, which holds
        # them as flat slices (shards_flat)
        returned = set() if frozen or self.whole is None else self.whole.returned
        rows = set() if frozen else {n for n in self.params if self.plan.stored_as_rows(n)}
        self._gather_into_parameters(
            [layout.name for layout in self.plan.params if layout.name not in returned | rows and (
                frozen or layout.name in self.stepped
                or (layout.requires_grad and self.plan.is_expert(layout.name)))])

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None
        if self.whole is not None:
            self.whole.zero_grad()
        self._unreduced.clear()

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
        if self.whole is not None:
            yield from self.whole.held_tensors()
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def _both(outer, inner):
    """``outer`` entered, then ``inner`` inside it."""
    with outer, inner:
        yield
