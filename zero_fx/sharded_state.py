"""Each rank's share of the model: parameter shards, their gradients, and the optimizer on them."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .passes.collective_code import gather_bucket
from .optimizer import check_elementwise, rebind_to_shards
from .plan import ParamLayout, ShardPlan
from .process_group import World


def cut_shard(full: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    """This rank's flat, padded slice of a parameter-shaped tensor (a fresh copy)."""
    flat = full.detach().reshape(-1)
    start, stop = layout.owned_range(rank)
    shard = flat.new_zeros(layout.shard_numel)
    shard[: stop - start] = flat[start:stop]
    return shard


class ShardedState:
    """The model and optimizer after sharding.

    ``shards[name]`` is what the optimizer steps on for parameter ``name``: in
    stages 1-3 a flat 1/N slice (the fp32 master), in stage 0 (replicated, as
    in DDP) the model's own parameter, untouched.

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

    [Note: freed parameters]
    In stage 3 the model keeps its ``nn.Parameter`` objects, with their shapes
    and dtypes, but their storage is resized to zero bytes: dynamo still traces
    the model through them, while the values live in ``shards`` (one flat
    ``nn.Parameter`` per parameter, which the optimizer now steps on). Reading
    a freed parameter outside the compiled step fails; use
    ``full_parameters()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 plan: ShardPlan, world: World, *, elementwise_optimizer: Optional[bool] = None):
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
        if plan.replicated:
            self.shards.update(self.params)
            return
        for name, param in self.params.items():
            layout = plan.layout(name)
            shard = torch.nn.Parameter(cut_shard(param, layout, world.rank),
                                       requires_grad=param.requires_grad)
            self.shards[name] = shard
        rebind_to_shards(
            optimizer,
            {param: self.shards[name] for name, param in self.params.items()},
            lambda param, tensor: cut_shard(tensor, plan.layout(self._name_of[id(param)]), world.rank),
        )
        for param in self.params.values():
            param.grad = None
            if plan.params_sharded:
                param.untyped_storage().resize_(0)

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

    def param_name(self, tensor: torch.Tensor) -> Optional[str]:
        """The plan name of a model parameter, or None for any other tensor."""
        return self._name_of.get(id(tensor))

    def shard_input(self, name: str) -> torch.Tensor:
        """What the compiled graph reads for parameter ``name``, outside autograd: its shard
        in stage 3, the whole parameter otherwise."""
        if self.plan.params_sharded:
            return self.shards[name].detach()
        return self.params[name].detach()

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
        """Add the received gradients to the shards' ``.grad``, for the optimizer."""
        for name, grad in self._received.items():
            shard = self.shards[name]
            shard.grad = grad if shard.grad is None else shard.grad + grad
        self._received.clear()

    @torch.no_grad()
    def refresh_parameters(self) -> None:
        """Stages 1-2: all-gather the updated shards into the whole parameters, one
        collective per bucket (``plan.buckets``, in plan order).

        A no-op in stage 0 (the optimizer stepped on the parameters) and stage 3
        (the next step gathers where it uses them).
        """
        if not self.plan.gathers_after_step:
            return
        for bucket in self.plan.buckets([layout.name for layout in self.plan.params]):
            fulls = self._gather(bucket, [self.shards[name].detach() for name in bucket])
            for name, full in zip(bucket, fulls):
                self.params[name].copy_(full)

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.grad = None

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter; in stage 3 gathered from all ranks (a collective:
        call it on every rank)."""
        if not self.plan.params_sharded:
            return {name: param.detach().clone() for name, param in self.params.items()}
        return {name: self._gather([name], [shard.detach()])[0].clone()
                for name, shard in self.shards.items()}

    def _gather(self, names: list[str], shards: list[torch.Tensor]) -> list[torch.Tensor]:
        layouts = [self.plan.layout(name) for name in names]
        return gather_bucket(*shards, numels=[l.numel for l in layouts],
                             shapes=[l.shape for l in layouts],
                             world_size=self.world.size, group_name=self.world.group_name)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank holds for the model: shards, their grads, optimizer state,
        and the model's parameters (freed in stage 3); each once."""
        seen = set()
        for tensor in self._all_held():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor

    def _all_held(self) -> Iterator[torch.Tensor]:
        yield from self.params.values()
        for shard in self.shards.values():
            yield shard
            if shard.grad is not None:
                yield shard.grad
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
