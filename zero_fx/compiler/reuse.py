"""Compilations reused within a process: a step of the same structure as one compiled before
takes that step's rewritten graph and lowered program instead of running our passes and the
lowering again.

[Note: one compilation per step structure]
A process compiles the same step more than once: a second model built like the first (a
sweep, a restart of the loop, every test of a file), a new optimizer object, a new
``zero_compile`` of the same function. Dynamo traces each of them again (its guards hold the
first step's objects by identity), and so does our capture; but from the captured graph on,
what a compilation makes depends only on what ``structure_key`` reads:

- the captured aten graph, node by node: each op and its arguments (other nodes by name,
  constants by value), each value's dtype, shape, strides and device, the metadata our
  passes read (``zero_*`` and ``custom``), and the tensor constants' bytes;
- the graph's inputs as lowered (the shards, their shapes and dtypes) and which parameter
  each is;
- the plan (``ShardPlan``, compared whole: layouts, stage, world, rank, owners, buckets),
  the options (``ZeroConfig``, compared whole: backend, regional, the user's passes, ...)
  and what the first call decided (forward only, where the update runs).

Two compilations equal in all of these get the same rewritten graph and the same lowered
program, whose values all come from its inputs at each call; the optimizer's in-graph
update is the running step's (``update_bucket`` reads it from a context variable), so
nothing of the first step's model, optimizer or values is in what is reused. A graph with a
value this key cannot read (an object compared by identity, a large tensor constant, a
function made in a closure), dynamic shapes, dumps, a compiler of the user's (which may keep
what it was given), CUDA graphs (which record their inputs' addresses), or an offload choice
still to make is compiled as before. The reused compilation is still checked: the rank agreement compares
the graph's signature as for any compilation.

What remains of a repeated compilation is dynamo's trace, the capture's copy and the first
run: on a 6-block GPT of width 128 at stage 3 on 2 gloo ranks, a new model's first call took
a median 1.15 s with Inductor (1.99 s compiled again, every other cache warm) and 1.17 s
with aot_eager (1.70 s) (bench/results/compile-reuse-2026-12-03).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.fx import GraphModule, Node

from .lower import Lowered

log = logging.getLogger("zero_fx")

MAX_KEPT = 32
"""Compilations kept per process (the least recently reused first out): each holds a
rewritten graph and its lowered program."""

CONSTANT_MAX_NUMEL = 1 << 16
"""A tensor constant of more elements is not hashed: a graph holding one is not reused."""

READ_META = ("custom",)
"""Node metadata our passes read beside ``val`` and the ``zero_*`` entries."""


class NotReusable(Exception):
    """Why a compilation cannot be keyed (and is compiled as before)."""


@dataclass
class KeptCompilation:
    plan: Any
    config: Any
    decided: tuple
    gm: GraphModule
    lowered: Lowered


_KEPT: "collections.OrderedDict[str, list[KeptCompilation]]" = collections.OrderedDict()


def structure_key(gm: GraphModule, inputs: Sequence[Any], names: Sequence[Optional[str]]) -> str:
    """A digest of what the rest of a compilation reads of the captured ``gm`` and of the
    lowered ``inputs`` ([Note: one compilation per step structure]); raises ``NotReusable``
    where it cannot say."""
    if torch._inductor.config.triton.cudagraphs:
        raise NotReusable("CUDA graphs record the first step's own input addresses")
    digest = hashlib.sha256()
    digest.update(lowering_state().encode())
    _graph_digest(gm, digest)
    for name, value in zip(list(names) + [None] * (len(inputs) - len(names)), inputs):
        digest.update(f"input {name} {described(value)}\n".encode())
    return digest.hexdigest()


def find(key: str, plan, config, decided: tuple) -> Optional[KeptCompilation]:
    """The kept compilation of ``key`` made for an equal plan, options and decisions."""
    for kept in _KEPT.get(key, ()):
        if kept.decided == decided and kept.plan == plan and kept.config == config:
            _KEPT.move_to_end(key)
            return kept
    return None


def keep(key: str, plan, config, decided: tuple, gm: GraphModule, lowered: Lowered) -> None:
    """Keep a compilation for later steps of the same structure."""
    _KEPT.setdefault(key, []).append(KeptCompilation(plan, config, decided, gm, lowered))
    _KEPT.move_to_end(key)
    while len(_KEPT) > MAX_KEPT:
        _KEPT.popitem(last=False)


def forget_all() -> None:
    """Drop every kept compilation (``torch._dynamo.reset()`` does not reach them)."""
    _KEPT.clear()


def lowering_settings() -> list[str]:
    """Inductor's and AOTAutograd's settings, which lowering reads."""
    return [described(torch._inductor.config.save_config_portable()),
            described(torch._functorch.config.save_config_portable())]


def lowering_state() -> str:
    """What the process may change between two compilations that lowering reads: its
    settings, and which function each name of zero_fx's own modules (its passes included)
    is bound to (a test that patches ``lower._compile_body`` gets a compilation of its own,
    not a kept one)."""
    bound = []
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith(("zero_fx.", "passes.")):
            continue
        bound.append(name + ":" + ",".join(
            f"{attr}={id(value):x}" for attr, value in sorted(vars(module).items())
            if callable(value) and not isinstance(value, type)))
    return hashlib.sha256("\n".join(lowering_settings() + bound).encode()).hexdigest()


def _graph_digest(gm: GraphModule, digest) -> None:
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        target = _target(gm, node, digest)
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        metas = sorted((k, described(v)) for k, v in node.meta.items()
                       if k.startswith("zero_") or k in READ_META)
        digest.update(f"{index[node]} {node.op} {target} {described(args)} "
                      f"{described(node.meta.get('val'))} {metas}\n".encode())
    digest.update(described(sorted((str(k), v) for k, v in gm.meta.items())).encode())


def _target(gm: GraphModule, node: Node, digest) -> str:
    if node.op in ("call_module", "get_attr"):
        attr = gm
        for part in str(node.target).split("."):
            attr = getattr(attr, part)
        if isinstance(attr, GraphModule):
            _graph_digest(attr, digest)
            return f"graph {node.target}"
        if isinstance(attr, torch.Tensor):
            return f"tensor {_tensor_bytes(attr)}"
        raise NotReusable(f"{node.op} {node.target} holds a {type(attr).__name__}")
    target = node.target
    if isinstance(target, str):
        return target
    qualname = getattr(target, "__qualname__", None)
    if qualname is None or "<locals>" in qualname or "<lambda>" in qualname:
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                               torch._ops.HigherOrderOperator)):
            return str(target)
        raise NotReusable(f"the graph calls {target!r}, made in a closure")
    return f"{getattr(target, '__module__', '')}.{qualname}"


def _tensor_bytes(t: torch.Tensor) -> str:
    plain = type(t) is torch.Tensor or type(t) is torch.nn.Parameter
    if t.numel() > CONSTANT_MAX_NUMEL or t.is_meta or not plain:
        raise NotReusable(f"a tensor constant of {t.numel()} elements")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{described(t)} {hashlib.sha256(data.numpy().tobytes()).hexdigest()}"


def described(value: Any) -> str:
    """A value as the key reads it: a (fake or real) tensor by its dtype, shape, strides,
    device and ``requires_grad``, containers and dataclasses item by item (sets sorted: their
    order changes with the process's string hashing), anything else by its ``repr`` where
    that is the value (not an object's identity)."""
    if isinstance(value, torch.Tensor):
        return (f"T({value.dtype}, {tuple(value.shape)}, {tuple(value.stride())}, "
                f"{value.device}, {value.requires_grad})")
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise NotReusable("symbolic sizes")
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "(" + ", ".join(map(described, value)) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{described(k)}: {described(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        return type(value).__name__ + "(" + ", ".join(sorted(map(described, value))) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__ + "(" + ", ".join(
            f"{f.name}={described(getattr(value, f.name))}" for f in dataclasses.fields(value)) + ")"
    text = repr(value)
    if " at 0x" in text:
        raise NotReusable(f"a {type(value).__name__} known by its identity")
    return text
