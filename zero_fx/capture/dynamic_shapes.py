"""Which sizes of the step's inputs dynamo traces as symbols: ``ZeroConfig.dynamic_shapes``.

[Note: one dynamic graph for every length]
Batches of text change length from call to call. A graph specialised to each length
compiles again for every new one (seconds to minutes each, and dynamo stops at its
``recompile_limit``). With ``dynamic_shapes="auto"`` the first call compiles for its
sizes, as before; from the first call whose tensor arguments differ in some size from
the first call's, ``ChangingSizes`` marks those dimensions (and, on every later call,
each dimension that has ever differed) with ``torch._dynamo.maybe_mark_dynamic``, so
dynamo compiles once more with those sizes symbolic, and that graph serves every later
length. The capture then takes its dynamic path ([Note: dynamic shapes] in
step_graph.py): traced on fakes of dynamo's own fake mode, so what our passes or the
lowering assume about a size becomes one of dynamo's guards, checked on every call,
never a silent specialisation. A dimension the step does specialise (a size of 0 or 1,
or a ``view`` to a fixed size) is specialised by dynamo without error ("maybe"), and
such a step compiles per shape as with ``"static"``.

Why not ``torch.compile(dynamic=None)``, dynamo's own automatic dynamic shapes: dynamo
keeps what it learns of a frame's sizes per code location, for the whole process
(``torch._dynamo.pgo``, keyed by file, line and name), and every compiled step runs the
same ``CompiledStep._traced_step``. One step's sizes then made another step's first
graph dynamic: after a step on batches of 4 and a step on batches of 2 elsewhere in the
process, a third step's first call compiled a dynamic graph, and two ranks whose earlier
steps differed traced different graphs (the rank agreement check caught it). The sizes a
step has seen are its own here, and the same on every rank that was given the same
batches.

Only activations change size with the batch: parameters (dynamo keeps them static,
``force_parameter_static_shapes``), their shards, and therefore every collective our
passes insert keep the sizes of the plan, so the rewritten step communicates exactly as
a static one. A dynamic graph is lowered whole, not by regions (``by_regions`` in
compiler/lower.py): regional compilation keys its bodies by static layouts. The cost of
the symbols at run time is measured by bench/experiments/dynamic_lengths.py. ``dynamic_shapes=
"static"`` keeps one graph per distinct shape, for a user who buckets lengths to a few
values and wants each graph specialised.

[Note: a changing int argument]
A step given the iteration number, as a nanoGPT loop moved into the step computes its
learning rate from it (``lr = get_lr(it)``), would compile a graph per value: dynamo
specialises Python ints. With ``dynamic_shapes="auto"``, an int argument of the step
(positional or keyword, not a bool) that differs from the first call's is named in
``torch.compiler.config.dynamic_sources`` for every later call (``number_sources``), so
dynamo traces it as a symbol from then on: one more compilation, and the learning rate
computed from it is a value the graph hands back, written into the optimizer's groups
after the graph ([Note: hyperparameters written inside the step] in step_calls.py). A
branch on it (a warm-up's ``if it < warmup``) is one of dynamo's guards, and crossing it
compiles once more. Floats are not named: dynamo specialises a float argument whatever its
sources say, and a float that changes compiles a graph per value.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class ChangingSizes:
    """The sizes of a step's tensor arguments on its first call, and which have changed since.

    ``marked(args, kwargs)`` before each call marks every changed dimension dynamic on this
    call's tensors (``dynamic_shapes="auto"``); with ``"static"`` it changes nothing."""

    def __init__(self, dynamic_shapes: str):
        self.enabled = dynamic_shapes == "auto"
        self._first: Optional[tuple[Any, list[Optional[torch.Size]]]] = None
        """The first call's argument structure and each argument's size (None: not a tensor)."""
        self.changed: set[tuple[int, int]] = set()
        """(argument position in the flattened arguments, dimension) that have differed."""
        self._first_ints: Optional[dict[str, int]] = None
        """The first call's int arguments, by dynamo's name for them."""
        self.changed_ints: set[str] = set()
        """Dynamo's names of the int arguments that have differed ([Note: a changing int
        argument])."""

    def ints_traced_as_symbols(self, args: tuple, kwargs: dict):
        """While the step is called: the int arguments that have changed traced as symbols
        ([Note: a changing int argument]), beside any sources the user named."""
        sources = self.number_sources(args, kwargs)
        if not sources:
            return contextlib.nullcontext()
        given = torch.compiler.config.dynamic_sources
        return torch.compiler.config.patch(
            dynamic_sources=",".join(s for s in (given, sources) if s))

    def number_sources(self, args: tuple, kwargs: dict) -> str:
        """The step's int arguments that have changed since the first call, as dynamo's
        ``dynamic_sources`` names them in the traced step (``CompiledStep._traced_step(self,
        *args, **kwargs)``); "" for none ([Note: a changing int argument])."""
        if not self.enabled:
            return ""
        ints = {f"L['args'][{i}]": a for i, a in enumerate(args) if _is_int(a)}
        ints.update({f"L['kwargs'][{k!r}]": v for k, v in kwargs.items() if _is_int(v)})
        if self._first_ints is None:
            self._first_ints = ints
            return ""
        self.changed_ints.update(name for name, value in ints.items()
                                 if name in self._first_ints and self._first_ints[name] != value)
        return ",".join(sorted(name for name in self.changed_ints if name in ints))

    def marked(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with the dimensions that changed marked dynamic, on tensors
        of their own (``_handed_to_the_step``): the caller's tensors stay unmarked."""
        if not self.enabled:
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        sizes = [leaf.shape if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        if self._first is None:
            self._first = (spec, sizes)
            return args, kwargs
        first_spec, first_sizes = self._first
        if spec != first_spec:
            return args, kwargs  # other arguments altogether: dynamo compiles for them as they are
        for position, (size, first) in enumerate(zip(sizes, first_sizes)):
            if size is None or first is None or len(size) != len(first):
                continue
            self.changed.update((position, dim) for dim, (a, b) in enumerate(zip(size, first))
                                if a != b)
        handed: dict[int, torch.Tensor] = {}  # the caller's tensor (by id) -> what the step gets
        for position in sorted({position for position, _ in self.changed}):
            leaf = leaves[position]
            dims = [dim for p, dim in self.changed if p == position and sizes[position] is not None
                    and dim < len(sizes[position])]
            if not dims or leaf.requires_grad or _marked_by_user(leaf):
                continue
            if id(leaf) not in handed:
                handed[id(leaf)] = _handed_to_the_step(leaf)
            leaves[position] = handed[id(leaf)]
            torch._dynamo.maybe_mark_dynamic(leaves[position], dims)
        return tree_unflatten(leaves, spec) if handed else (args, kwargs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


USER_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_static_indices",
              "_dynamo_unbacked_indices", "_dynamo_strict_unbacked_indices")
"""The attributes ``torch._dynamo.mark_dynamic`` and its kin set on a tensor."""


def _marked_by_user(tensor: torch.Tensor) -> bool:
    """The caller marked some dimension of ``tensor`` (``mark_dynamic``, ``mark_static``): its
    marks decide, and ours would change the attributes its graph was compiled with."""
    return any(hasattr(tensor, attr) for attr in USER_MARKS)


def _handed_to_the_step(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of ``tensor``'s values to mark: its alias (``detach()``: the marks are
    attributes of the tensor object, and the caller's own tensor passed to another compiled
    function would carry them there), or a contiguous copy ([Note: a marked view is copied])."""
    if tensor.storage_offset() != 0 or not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.detach()


# [Note: a marked view is copied]
# Dynamo gives a tensor with a symbolic size a symbolic storage offset, except an offset of 0
# or 1, which it specialises, and symbolic strides where they do not follow from the sizes.
# Each rank's slice of a global batch, x[rank * n:(rank + 1) * n], starts its storage on rank
# 0 only: rank 0 traced a graph without the offset's symbol and rank 1 one with it, and the
# ranks' agreement check refused the step. A batch cut to its length, x[:, :t], keeps the
# whole batch's row stride, a symbol of its own where a contiguous tensor has none. A tensor
# marked here that is not contiguous from the start of its storage is handed to the step as
# a contiguous copy (the batch, not a parameter: a few kilobytes of token ids), so every rank
# traces the same graph. The step then sees the copy, not the caller's tensor: a step that
# wrote into its input in place would write into the copy. A tensor that requires a gradient,
# or that the caller marked itself, is neither copied nor marked.
