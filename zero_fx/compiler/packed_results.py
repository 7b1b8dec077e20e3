"""Results passed whole between the step's own graph's calls ([Note: results passed whole]).

[Note: results passed whole]
The outer graph of regional compilation (zero_fx/compiler/regions.py) runs as Python, one
line per node. After the bodies are cut out, most of its nodes are not ops but getitems:
a block's forward body returns 16 values, 12 of which only that block's backward body
reads; a gathered bucket's copy-out is a list of 4 parameters, all read by one body; a
block's backward body returns the 4 weight gradients that only its bucket's
``_chunk_cat`` reads. Each value was taken out of its tuple by a node of its own, only
to be put into the next call's arguments: 489 of the 853 nodes at GPT-2's 12 blocks.

So values that travel together travel as one:

- A **pack**: the values of one call that are each read by exactly one and the same
  later node (a body's call, or an op taking a list, like the bucket's ``_chunk_cat``)
  come back from the call as a tuple of their own (the call's ``packs=``), taken out by
  one getitem and passed on whole.
- A **list passed whole**: a list-valued op (a gathered bucket's
  ``split_with_sizes_copy``) whose every element only one body reads is passed to that
  body as the list.

A body's call then says which of its arguments' elements are its inputs (``take=``,
one ``(argument, element)`` pair per input, element -1 for the argument itself), and the
call takes them out, in the order the body was compiled for.

Lifetimes do not change: a pack or a list holds values that had the same single reader,
and it dies right after that reader, when they died before. A value with any other
reader stays a getitem of its own. What changes is where the tuple is taken apart: in
the call, not in the graph, which costs the same subscripts; the outer graph is the
program's listing, and it gets shorter by the values passed whole.
"""

from __future__ import annotations

import operator
from typing import Optional

from torch.fx import GraphModule, Node

REGION_META = "zero_region"
"""``node.meta`` key of a body's call in the outer graph (the body's name)."""


def pass_results_whole(gm: GraphModule) -> None:
    """Pack each body call's results that have one reader in common, and pass lists whose
    elements one body reads whole ([Note: results passed whole]); ``gm`` changes in place."""
    for call in [n for n in gm.graph.nodes if _is_body_call(n)]:
        _pack_results(gm, call)
    for call in [n for n in gm.graph.nodes if _is_body_call(n)]:
        _take_inputs(gm, call)


def unpack(inputs: tuple, take: Optional[tuple]) -> tuple:
    """A body's inputs from its call's arguments and ``take``."""
    if take is None:
        return inputs
    return tuple(inputs[a] if e < 0 else inputs[a][e] for a, e in take)


def pack(results, packs: Optional[tuple]) -> tuple:
    """A body's results with ``packs`` (tuples of result indices) as tuples of their own,
    after the results in no pack."""
    if not packs:
        return results
    packed = {i for group in packs for i in group}
    return (*(r for i, r in enumerate(results) if i not in packed),
            *(tuple(results[i] for i in group) for group in packs))


def _is_body_call(node: Node) -> bool:
    return node.op == "call_module" and REGION_META in node.meta


def _sole_reader(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _pack_results(gm: GraphModule, call: Node) -> None:
    """Group ``call``'s getitems by their one reader; groups of two or more become packs."""
    results = sorted((n for n in call.users if n.target is operator.getitem), key=lambda n: n.args[1])
    if len(results) != len(call.users):
        return
    groups: dict[Node, list[Node]] = {}
    for result in results:
        reader = _sole_reader(result)
        if reader is not None and (_is_body_call(reader) or _list_reader(reader, result) is not None):
            groups.setdefault(reader, []).append(result)
    for reader, group in list(groups.items()):
        if _is_body_call(reader):
            continue
        listed = _list_reader(reader, group[0])
        if len(listed) != len(group) or set(listed) != set(group):
            del groups[reader]  # the list holds values of another call too
        else:
            groups[reader] = list(listed)  # in the list's order
    groups = {reader: group for reader, group in groups.items() if len(group) > 1}
    if not groups:
        return
    packs = tuple(tuple(r.args[1] for r in group) for group in groups.values())
    packed = {i for group in packs for i in group}
    rest = [r for r in results if r.args[1] not in packed]
    for position, result in enumerate(rest):
        result.args = (call, position)
    call.kwargs = {**call.kwargs, "packs": packs}
    call.meta["val"] = pack(call.meta["val"], packs)
    anchor = rest[-1] if rest else call
    for number, (reader, group) in enumerate(groups.items()):
        with gm.graph.inserting_after(anchor):
            bundle = gm.graph.call_function(operator.getitem, (call, len(rest) + number))
        bundle.meta["val"] = tuple(r.meta.get("val") for r in group)
        anchor = bundle
        if _is_body_call(reader):  # each an element of the bundle; _take_inputs passes it whole
            for index, result in enumerate(group):
                with gm.graph.inserting_after(bundle):
                    element = gm.graph.call_function(operator.getitem, (bundle, index))
                element.meta = dict(result.meta)
                result.replace_all_uses_with(element)
        else:
            reader.args = (bundle, *reader.args[1:])
        for result in group:
            gm.graph.erase_node(result)


def _list_reader(reader: Node, result: Node) -> Optional[list]:
    """The list argument of ``reader`` (its first) when ``result`` is in it, else None."""
    first = reader.args[0] if reader.op == "call_function" and reader.args else None
    return first if isinstance(first, (list, tuple)) and result in first else None


def _take_inputs(gm: GraphModule, call: Node) -> None:
    """Pass ``call`` whole the lists and bundles whose elements it alone reads."""
    sources: list[Node] = []
    take: list[tuple[int, int]] = []
    taken_apart: list[Node] = []
    for arg in call.args:
        whole = _whole_source(arg, call)
        source, element = (whole, arg.args[1]) if whole is not None else (arg, -1)
        if whole is not None:
            taken_apart.append(arg)
        if source not in sources:
            sources.append(source)
        take.append((sources.index(source), element))
    if not taken_apart:
        return
    call.args = tuple(sources)
    call.kwargs = {**call.kwargs, "take": tuple(take)}
    for getitem in taken_apart:
        if not getitem.users:
            gm.graph.erase_node(getitem)


def _whole_source(arg, call: Node) -> Optional[Node]:
    """The list or bundle ``arg`` is an element of, when ``call`` alone reads all of its
    elements; else None."""
    if not (isinstance(arg, Node) and arg.target is operator.getitem and _sole_reader(arg) is call):
        return None
    source = arg.args[0]
    if _is_body_call(source) or not isinstance(source.meta.get("val"), (list, tuple)):
        return None  # a body's results are passed whole as packs, made above
    elements = list(source.users)
    if len(elements) < 2 or any(e.target is not operator.getitem or _sole_reader(e) is not call
                                for e in elements):
        return None
    return source
