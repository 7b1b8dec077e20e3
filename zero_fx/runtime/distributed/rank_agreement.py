"""Ranks that disagree fail fast, before the first collective of a step.

[Note: checking that ranks agree]
Every rank must issue the same collectives in the same order. A rank whose
step was traced from other shapes (a smaller last batch on one rank) or whose
code branches on the rank compiles another graph: its collectives then pair
with the wrong peers' and the job hangs, or runs on mismatched buffers. So,
right before running its graph, each rank all-gathers one 64-bit fingerprint of
that graph (every node with its op, arguments, shape and dtype; a device by
its type only, since each rank's graph names its own ``cuda:<rank>``) and of the
shapes its inputs have in this call (a graph with dynamic sizes would run
unequal batches without complaint) on a side gloo
group (CPU tensors, whatever the training backend). All equal: run. Not: every
rank learns it at the same point, the ranks exchange a short description of
their graphs (inputs and collectives), and each raises ``RanksDisagreeError``
naming the ranks and the first difference. It costs one 8-byte all-gather per
call; ``zero_compile(check_ranks=False)`` skips it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from ...base.formatting import short_dtype
from ...inspection.graph_listing import COLLECTIVE_KINDS, format_rows, graph_rows
from .process_group import world_timeout
from ...errors import RanksDisagreeError


@dataclass(frozen=True)
class GraphSignature:
    """What ranks compare: a fingerprint of the whole graph, and the lines a person reads."""

    fingerprint: bytes
    input_names: tuple[str, ...]
    """The graph's inputs that are not parameters, in order."""
    collectives: tuple[str, ...]
    """Each collective of the graph, in order: kind, buffer and what it moves."""


@dataclass(frozen=True)
class CallSignature:
    """One call: the graph, and the shapes its inputs have this time (a graph with dynamic
    sizes runs with different shapes on different ranks without any other difference)."""

    fingerprint: int
    inputs: tuple[str, ...]
    collectives: tuple[str, ...]


def graph_signature(gm: GraphModule, plan) -> GraphSignature:
    rows = _tensor_parallel_neutral(graph_rows(gm, plan, rank_neutral=True), plan)
    neutral = _expert_neutral(plan)
    return GraphSignature(
        fingerprint=hashlib.sha256(neutral(format_rows(rows)).encode()).digest(),
        input_names=tuple(r.name for r in rows if r.kind == "input"),
        collectives=tuple(neutral(f"{r.kind} {r.value}: {r.note}") for r in rows
                          if r.kind in COLLECTIVE_KINDS),
    )


def _tensor_parallel_neutral(rows: list, plan) -> list:
    """Under tensor parallelism a rank's local ops may hold numbers of its own: a
    vocabulary-parallel embedding subtracts its rank's first row (rank 0 of "tp" 0, rank 1
    32, ...). What the ranks compare then reads each number in an op's arguments as
    ``<n>``; ops, shapes, dtypes and the collectives are compared as they are."""
    if getattr(plan, "tensor_parallel", None) is None:
        return rows
    numbered = {row.name: f"%{row.index}" for row in rows}  # names may differ too (getitem_51)

    def neutral(args: str) -> str:
        return _NUMBER.sub("<n>", _WORD.sub(lambda m: numbered.get(m.group(0), m.group(0)), args))

    return [dataclasses.replace(row, name=numbered[row.name],
                                inputs=tuple(numbered.get(n, n) for n in row.inputs),
                                args=row.args if row.kind in COLLECTIVE_KINDS else neutral(row.args))
            for row in rows]


_NUMBER = re.compile(r"(?<![\w.%])-?\d+(\.\d+)?(e-?\d+)?")
_WORD = re.compile(r"[A-Za-z_]\w*")


def _expert_neutral(plan):
    """Under expert parallelism each rank's graph reads its own experts (rank 0 experts 0-3,
    rank 1 experts 4-7, ...): the same computation on other parameters. Their index reads
    as ``<e>`` in what ranks compare, in dotted names and in the names dynamo derives
    (``experts_modules_4_``)."""
    parallel = getattr(plan, "expert_parallel", None)
    if parallel is None or not parallel.slices:  # none, or experts as rows: same names
        return lambda text: text
    lists = {_experts_list(name) for name in parallel.slices}
    pattern = re.compile("(" + "|".join(re.escape(n) for n in sorted(lists)) +
                         r")(\.|_modules_|_)\d+(?=[._])")
    return lambda text: pattern.sub(r"\1\2<e>", text)


def _experts_list(parameter: str) -> str:
    """The experts list's own name in an expert's parameter name ("...experts.4.w1.weight"
    -> "experts"): the part before the last number."""
    parts = parameter.split(".")
    index = max(i for i, part in enumerate(parts) if part.isdigit())
    return parts[index - 1]


def call_signature(graph: GraphSignature, inputs: Sequence) -> CallSignature:
    """``inputs``: this call's values of the graph's non-parameter inputs."""
    pairs = sorted(zip(graph.input_names, inputs),  # tensors first: they say more than a size
                   key=lambda pair: not isinstance(pair[1], torch.Tensor))
    described = tuple(f"{name}: {_describe(value)}" for name, value in pairs)
    digest = hashlib.sha256(graph.fingerprint + "\n".join(described).encode()).digest()
    return CallSignature(fingerprint=int.from_bytes(digest[:8], "little", signed=True),
                         inputs=described, collectives=graph.collectives)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{short_dtype(value.dtype)}[{', '.join(map(str, value.shape))}]"
    return repr(value)


class RankAgreement:
    """Compares the graph each rank is about to run ([Note: checking that ranks agree])."""

    def __init__(self, world_size: int, checked: bool):
        """``checked``: compare the ranks' graphs at all (``DebugOptions.check_ranks``, where
        there are other ranks to compare with, or a world of one keeps its collectives:
        [Note: collectives kept at a world of one] in process_group.py)."""
        self.world_size = world_size
        # a collective over all ranks: created on the first call, which every rank makes
        self.group: Optional[dist.ProcessGroup] = (
            dist.new_group(backend="gloo", timeout=world_timeout()) if checked else None)

    def values(self, value: int) -> list[int]:
        """Every rank's 64-bit ``value``, in rank order (one 8-byte all-gather on the side
        group, which every rank must make alike); ``[value]`` where nothing is compared."""
        if self.group is None:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        return [int(t) for t in everyone]

    def check(self, signature: CallSignature) -> None:
        if self.group is None:
            return
        if len(set(self.values(signature.fingerprint))) == 1:
            return
        signatures: list = [None] * self.world_size
        dist.all_gather_object(signatures, signature, group=self.group)
        raise RanksDisagreeError(disagreement(signatures))


def disagreement(signatures: Sequence[CallSignature]) -> str:
    """Which ranks differ from rank 0, and where first, in words."""
    reference = signatures[0]
    lines = ["the ranks are about to run different graphs, so their collectives would not pair "
             "up; nothing of this step ran:"]
    for rank, sig in enumerate(signatures[1:], start=1):
        if sig.fingerprint == reference.fingerprint:
            continue
        lines.append(f"  rank {rank} differs from rank 0: {_first_difference(reference, sig, rank)}")
    lines.append("Every rank must trace the same step: give each rank a batch of the same shapes "
                 "and dtypes (drop or pad a short last batch), and do not branch on the rank "
                 "inside the step. ZERO_FX_DUMP=<folder> writes each rank's graph to compare.")
    return "\n".join(lines)


def _first_difference(reference: CallSignature, other: CallSignature, rank: int) -> str:
    for what in ("inputs", "collectives"):
        mine, theirs = getattr(reference, what), getattr(other, what)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return f"{what[:-1]} {i}: rank 0 has {a}, rank {rank} has {b}"
        if len(mine) != len(theirs):
            return f"rank 0 has {len(mine)} {what}, rank {rank} has {len(theirs)}"
    return ("same inputs and collectives, different computation (does the step branch on the "
            "rank, or on a value that differs between ranks?)")
