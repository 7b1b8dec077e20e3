"""Regional compilation: each distinct run of compute is compiled once, the step's own
graph calls the compiled runs and issues the collectives ([Note: regional compilation]).

[Note: regional compilation]
Inductor's time grows with the graph it compiles, and a whole training step of a deep
model is thousands of nodes that mostly repeat: block 7's forward is block 3's with other
parameters. Cut the rewritten graph at every collective and every wait; what lies between
two of them is a run of compute. Runs that compute the same thing (same ops, same
arguments relative to the run, same shapes, dtypes and strides, the same values leaving
the run) share a signature, and each signature is compiled once, as a body of its own;
the outer graph calls a body where each of its runs stood. Compile time then grows with
the number of distinct runs, not with depth: three for a GPT-2-shaped model at 12 blocks
and at 48 (a block's forward, a block's backward, the head with the loss).

The outer graph is not compiled: it runs as Python, node by node, so collectives are
issued and waited for in exactly the graph's order, and a value the graph frees after a
body's call is freed there ("what runs is what the plan says" without a pin). A body
holds no collective and no wait, so a body can never reorder communication.

What a body holds is the compute of its run. The views and copies at a run's edges (a
gather's copy-out before the compute reads it, a gradient bucket's concatenation after
it) stay in the outer graph, and a run with fewer than ``MIN_REGION_OPS`` ops that
compute is not compiled at all: eager runs those as the same few copies a compiled body
would, while each body costs seconds of C++ compile, and the edges differ between the
first, middle and last blocks (which buckets they gather and reduce) where the compute
does not. With the edges inside, GPT-2's shape compiled eight bodies, one of them the
copy-out of every resident parameter, growing with depth; without, three. Runs that
take or return a non-tensor value stay in the outer graph too. Views are the exception
([Note: views only the body reads go in] in compute_runs.py).

Why not PyTorch's own repeated regions (``torch.compiler.nested_compile_region``, whose
bodies become ``invoke_subgraph`` calls inside one Inductor program): the outer program
is still compiled whole, so its time still grows with depth (measured 2026-11-24 on the
example GPT: 0.85x the whole program's compile time at 4 layers, 0.60x at 16 and
growing), the schedule must still be pinned around the calls, and torch 2.13's Inductor
on CPU corrupted its heap when a body returned a view or held a collective. A body
compiled on its own returns views through AOTAutograd's alias handling, and lives or
dies by the caller's references like any value of the graph.

[Note: a body's results keep their traced strides]
A body is compiled for the strides its inputs had in the trace, and Inductor asserts them
on every call (``assert_size_stride``). A result of another body is such an input, and
Inductor does not always return a result in its traced strides: on the HF Llama of the
peer benchmark (stage 3, 2 ranks) the attention's values, a ``cat`` of transposed views,
came back laid out as the views were where the trace had them contiguous, and the
backward body reading them failed its assertion at the first step. So each compiled
body's results are checked against their traced strides as they come back, and one in
other strides is copied into them (six copies of 1.25 MiB a step there; none on the
GPT example). A view a body returns keeps its strides by construction (AOTAutograd
regenerates it from its base), so no alias is broken by a copy.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _make_graph_module

from ..passes.check_invariants import check_in_place_order
from ..passes.common.predicates import GATHERED_META, Phase, is_collective, is_wait, phase_of
from ..plan.layout import block_of
from .compute_runs import compute_runs, computes, drop_identity_views, sink_views
from .packed_results import REGION_META, pack, pass_results_whole, unpack

log = logging.getLogger("zero_fx")

BodyCompiler = Callable[[GraphModule, list], Callable]
"""Compiles one body: ``(graph module, example fake inputs) -> callable(*inputs)``."""


@dataclass(frozen=True)
class Region:
    """One compiled body and where the step runs it."""

    name: str
    """Its submodule's name in the outer graph ("region_3")."""
    nodes: int
    """Nodes of the body's graph (its ops, their getitems and views)."""
    phase: str
    """"forward", "backward" or "forward and backward"."""
    runs_at: tuple[str, ...]
    """For each call, the blocks whose gathered parameters it reads ("transformer.h.3"),
    or "-" when it reads none."""
    seconds: float
    """Time to compile the body."""
    code: str
    """The body's graph, as Python."""


@dataclass(frozen=True)
class RegionReport:
    """What regional compilation did to one graph."""

    regions: tuple[Region, ...]
    outer_nodes: int
    """Nodes left in the outer graph: collectives, waits, views, copies, short runs, the calls."""
    outer_ops: int
    """Of those, the ops that compute (``computes``), run one by one."""
    graph_nodes: int
    """Nodes of the rewritten graph before it was cut."""
    outer_dispatches: int
    """Of the outer nodes, those that run an op or a body (each a Python dispatch, on CUDA
    a launch): all but its inputs, its output and the getitems that take results apart."""
    outer_code: str = field(repr=False, compare=False)
    """The program that runs, as Python: the graph with its runs replaced by calls of the
    bodies. (Code, not the module: a report is data, saved and sent like the rest of
    ``explain()``.)"""

    @property
    def calls(self) -> int:
        return sum(len(r.runs_at) for r in self.regions)

    def __str__(self) -> str:
        compiled = sum(r.nodes for r in self.regions)
        lines = [f"regional compilation: {self.calls} runs of compute in {len(self.regions)} "
                 f"compiled bodies ({compiled} nodes compiled for {self.graph_nodes} in the graph, "
                 f"{sum(r.seconds for r in self.regions):.1f} s); {self.outer_dispatches} ops run "
                 f"from the step's own graph: collectives and waits in its order, the bodies' "
                 f"calls, views, copies and {self.outer_ops} other ops ({self.outer_nodes} nodes "
                 f"with its inputs and the getitems that take results apart)"]
        for region in self.regions:
            lines.append(f"  {region.name}: {region.nodes} nodes, {region.phase}, "
                         f"{len(region.runs_at)} call(s): {_places(region.runs_at)}")
        return "\n".join(lines)


class CompiledRegion(torch.nn.Module):
    """A compiled body as a submodule of the outer graph (its listing names it)."""

    def __init__(self, compiled: Callable, region_name: str,
                 strides: Sequence[Optional[tuple[int, ...]]] = ()):
        super().__init__()
        self.compiled = compiled
        self.region_name = region_name
        self.strides = tuple(strides)
        """Each result's strides as traced ([Note: a body's results keep their traced
        strides]); None where a copy cannot or need not restore them."""

    def forward(self, *inputs, take=None, packs=None):
        """The body on its inputs; ``take`` and ``packs``: how the outer graph passes them and
        their results whole ([Note: results passed whole] in packed_results.py)."""
        results = self.compiled(*unpack(inputs, take))
        if self.strides:
            results = [as_traced(r, s) for r, s in zip(results, self.strides)]
        return pack(results, packs)


def as_traced(result, strides: Optional[tuple[int, ...]]):
    """``result`` in its traced ``strides`` ([Note: a body's results keep their traced
    strides]): itself if it is in them already (or ``strides`` is None), else a copy."""
    if strides is None or not isinstance(result, torch.Tensor) or result.stride() == strides:
        return result
    return torch.empty_strided(result.shape, strides, dtype=result.dtype,
                               device=result.device).copy_(result)


def traced_strides(value) -> Optional[tuple[int, ...]]:
    """A traced result's strides, where its sizes and strides are plain numbers and it has
    elements; else None."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return None
    if not all(isinstance(n, int) for n in (*value.shape, *value.stride())):
        return None
    if _overlapping(tuple(value.shape), tuple(value.stride())):
        return None  # an expanded view (a stride of 0): no copy can be laid out so
    return tuple(value.stride())


def _overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``strides`` may share a location:
    each dimension's stride, smallest first, must reach past all that the smaller ones
    span."""
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz > 1):
        if stride < span:
            return True
        span += (size - 1) * stride
    return False


def compile_regions(gm: GraphModule, compile_body: BodyCompiler) -> tuple[GraphModule, RegionReport]:
    """``gm`` with each run of compute replaced by a call of its compiled body; ``gm`` is
    changed in place and returned."""
    graph_nodes = len(gm.graph.nodes)
    drop_identity_views(gm)
    sink_views(gm)
    groups: dict[str, list[list[Node]]] = {}
    runs = compute_runs(gm)
    check_in_place_order(gm, "regional compilation moved it")
    for run in runs:
        groups.setdefault(signature(run)[0], []).append(run)
    regions = []
    for number, runs in enumerate(groups.values()):
        name = f"region_{number}"
        _, inputs, outputs = signature(runs[0])
        body = _body(runs[0], inputs, outputs)
        code = body.code
        start = time.perf_counter()
        compiled = compile_body(body, [i.meta["val"] for i in inputs])
        seconds = time.perf_counter() - start
        log.info("zero_fx: compiled %s (%d nodes, %s, runs %d time(s)) in %.1f s",
                 name, len(runs[0]), _phase(runs[0]), len(runs), seconds)
        gm.add_submodule(name, CompiledRegion(compiled, name,
                                              [traced_strides(o.meta.get("val")) for o in outputs]))
        places = []
        for run in runs:
            _, inputs, outputs = signature(run)  # its own inputs, renamed by earlier calls
            places.append(_blocks_read([*inputs, *run]))
            _replace_with_call(gm, name, run, inputs, outputs)
        regions.append(Region(name, len(runs[0]), _phase(runs[0]), tuple(places), seconds, code))
    pass_results_whole(gm)
    gm.graph.lint()
    gm.recompile()
    outer_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function" and computes(n)
                    and not is_collective(n) and not is_wait(n))
    dispatches = sum(1 for n in gm.graph.nodes
                     if n.op in ("call_function", "call_module") and n.target is not operator.getitem)
    return gm, RegionReport(tuple(regions), len(gm.graph.nodes), outer_ops, graph_nodes,
                            dispatches, gm.code)


def signature(run: Sequence[Node]) -> tuple[str, list[Node], list[Node]]:
    """``(signature, inputs, outputs)`` of a run: runs with equal signatures compute the
    same function of their inputs, in the same order of inputs and outputs."""
    local = {node: i for i, node in enumerate(run)}
    inputs: list[Node] = []
    index: dict[Node, int] = {}

    def relative(arg):
        if isinstance(arg, Node):
            if arg in local:
                return ("L", local[arg])
            if arg not in index:
                index[arg] = len(inputs)
                inputs.append(arg)
            return ("I", index[arg])
        if isinstance(arg, (list, tuple)):
            return tuple(relative(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, relative(v)) for k, v in arg.items()))
        return arg

    parts = [(str(n.target), relative(n.args), relative(n.kwargs), _value_signature(n.meta.get("val")))
             for n in run]
    outputs = [n for n in run if any(user not in local for user in n.users)]
    parts.append(("outputs", tuple(local[o] for o in outputs)))
    parts.append(("inputs", tuple(_value_signature(i.meta.get("val")) for i in inputs)))
    return repr(parts), inputs, outputs


def _value_signature(value) -> object:
    """What a compiled body assumes of a value: shape, dtype, strides, device, whether its
    start is 16-byte aligned (what Inductor specializes on), not its offset (one block's
    slice of a tensor over all blocks starts elsewhere than the next block's), and the
    conjugate and negative bits ([Note: views that read differently] in
    passes/common/predicates.py)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, tuple(value.stride()),
                value.device.type, value.storage_offset() * value.element_size() % 16 == 0,
                value.is_conj(), value.is_neg())
    if isinstance(value, (tuple, list)):
        return tuple(_value_signature(v) for v in value)
    return type(value).__name__


def _body(run: Sequence[Node], inputs: Sequence[Node], outputs: Sequence[Node]) -> GraphModule:
    graph = Graph()
    env = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"input_{i}")
        env[node].meta = dict(node.meta)
    for node in run:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in outputs))
    # lazy: [Note: graph modules that generate their code when it is used] in backend.py
    return _make_graph_module(torch.nn.Module(), graph)


def _replace_with_call(gm: GraphModule, name: str, run: Sequence[Node], inputs: Sequence[Node],
                       outputs: Sequence[Node]) -> None:
    graph = gm.graph
    with graph.inserting_before(run[0]):
        call = graph.call_module(name, tuple(inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        call.meta[REGION_META] = name
        results = []
        for i, node in enumerate(outputs):
            results.append(graph.call_function(operator.getitem, (call, i)))
            results[-1].meta = dict(node.meta)
    inside = set(run)
    for node, result in zip(outputs, results):
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for node in reversed(run):
        graph.erase_node(node)


def _blocks_read(nodes: Sequence[Node], shown: int = 3) -> str:
    """The blocks whose gathered parameters ``nodes`` read, in a few words."""
    blocks = []
    for node in nodes:
        gathered = node.meta.get(GATHERED_META)
        if gathered and block_of(gathered[0]) not in blocks:
            blocks.append(block_of(gathered[0]))
    if len(blocks) > shown:
        return f"{', '.join(blocks[:shown - 1])}, ... {blocks[-1]} ({len(blocks)} blocks)"
    return ", ".join(blocks) or "-"


def _phase(run: Sequence[Node]) -> str:
    """The phase of what the run computes (the views it takes in may be the other's)."""
    phases = {phase_of(n) for n in run if computes(n)} or {phase_of(n) for n in run}
    if phases == {Phase.FORWARD, Phase.BACKWARD}:
        return "forward and backward"
    return phases.pop().value


def _places(places: Sequence[str], shown: int = 4) -> str:
    """The places a body runs at, in a line: the first few and how many more."""
    if len(places) <= shown:
        return "; ".join(places)
    return "; ".join(places[:shown]) + f"; ... ({len(places) - shown} more)"
