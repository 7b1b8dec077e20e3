"""Experiment for issue 21: compile each repeated stretch of the rewritten step once.

    python -m bench.regional --layers 4 8 16          # 2 gloo ranks, Inductor, cold caches

Not part of the library yet. A user pass (``zero_fx.after("check_invariants", ...)``)
cuts the rewritten stage-3 graph into the runs of compute between collective events,
gives each run a structural signature (ops, arguments relative to the run, shapes,
which values leave it), and replaces every run whose signature repeats with a call of
one shared body (``torch.ops.higher_order.invoke_subgraph``); Inductor lowers a shared
body once (``repeated_subgraphN`` in its program). No collective and no wait is inside
a body, so the schedule stays in the outer graph. Each (mode, depth) is a fresh run
with an empty Inductor cache; it prints the first call's time (capture, passes,
Inductor) and how far the losses of 4 steps differ.

What it found (2026-11-24, GPT width 64, seq 64, 2 ranks, persistence_threshold=0):

- Inductor 2.13 on CPU corrupts the heap ("malloc_consolidate(): invalid chunk size")
  when a body returns a *view* (here a view op's result, of an input or of a value
  computed inside). Bodies must return bases and the views be taken outside; this
  script clones them instead (more memory: not what the library should do).
- A body that holds a collective, or whose run crosses a collective, crashed the same
  way: collectives and waits stay outside the bodies.
- The pin (``PinSchedule``) sees no anchor inside a body, so this runs with
  ``pin_schedule=False``; a library version would make each body call an anchor, and
  the lowered-code readers (order, buffer lifetimes) would have to read the bodies.
- First call, cold Inductor cache, whole graph / outlined: 4 layers 33.2 / 28.2 s (0.85),
  8 layers 40.4 / 29.9 s (0.74), 16 layers 57.9 / 35.0 s (0.60); losses equal to the
  last bit. The outlined time still grows with depth (the outer graph, capture and the
  passes stay linear: 308 outer nodes at 4 layers, 956 at 16).
"""

from __future__ import annotations

import argparse
import operator
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.fx import Graph, GraphModule, Node

from .runs import free_port, join_spawned_group

MIN_RUN = 8
"""Runs shorter than this stay in the outer graph."""


def compute_runs(gm: GraphModule) -> list[list[Node]]:
    """Maximal runs of calls with no collective and no wait among them."""
    from zero_fx.passes.predicates import is_collective, is_wait

    runs, current = [], []
    for node in gm.graph.nodes:
        if node.op == "call_function" and not is_collective(node) and not is_wait(node):
            current.append(node)
            continue
        if len(current) >= MIN_RUN:
            runs.append(current)
        current = []
    return runs


def _value_signature(value) -> object:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, tuple(value.stride()))
    if isinstance(value, (tuple, list)):
        return tuple(_value_signature(v) for v in value)
    return type(value).__name__


def signature(run: list[Node]) -> tuple[str, list[Node], list[Node]]:
    """``(signature, inputs, outputs)`` of a run: equal signatures compute the same thing."""
    local = {n: i for i, n in enumerate(run)}
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

    parts = [(str(n.target), relative(n.args), relative(n.kwargs),
              _value_signature(n.meta.get("val"))) for n in run]
    outputs = [n for n in run if any(user not in local for user in n.users)]
    parts.append(("outputs", tuple(local[o] for o in outputs)))
    parts.append(("inputs", tuple(_value_signature(i.meta.get("val")) for i in inputs)))
    return repr(parts), inputs, outputs


def _body(run: list[Node], inputs: list[Node], outputs: list[Node]) -> GraphModule:
    from zero_fx.passes.predicates import is_view

    graph = Graph()
    env = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"arg{i}")
        env[node].meta = dict(node.meta)
    for node in run:
        env[node] = graph.node_copy(node, env.__getitem__)
    results = []
    for node in outputs:
        value = env[node]
        if is_view(node):  # a body returning a view corrupts Inductor's program (above)
            value = graph.call_function(torch.ops.aten.clone.default, (value,))
            value.meta = dict(node.meta)
        results.append(value)
    graph.output(tuple(results))
    return GraphModule(torch.nn.Module(), graph)


def outline_repeated_runs(gm: GraphModule) -> GraphModule:
    groups: dict[str, list[list[Node]]] = {}
    for run in compute_runs(gm):
        groups.setdefault(signature(run)[0], []).append(run)
    repeated = [runs for runs in groups.values() if len(runs) > 1]
    for number, runs in enumerate(repeated):
        name = f"repeated_run_{number}"
        for k, run in enumerate(runs):
            _, inputs, outputs = signature(run)  # again: earlier outlining renamed inputs
            if k == 0:
                gm.add_submodule(name, _body(run, inputs, outputs))
            with gm.graph.inserting_before(run[0]):
                body = gm.graph.get_attr(name)
                call = gm.graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                              (body, name, *inputs))
                call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
                results = []
                for i, node in enumerate(outputs):
                    results.append(gm.graph.call_function(operator.getitem, (call, i)))
                    results[-1].meta = dict(node.meta)
            inside = set(run)
            for node, result in zip(outputs, results):
                node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
            for node in reversed(run):
                gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    print(f"outlined {sum(map(len, repeated))} runs into {len(repeated)} bodies; "
          f"{len(gm.graph.nodes)} nodes left outside", flush=True)
    return gm


def _rank(rank: int, world: int, port: int, layers: int, regional: bool, out) -> None:
    import zero_fx
    from examples.gpt import GPT, GPTConfig
    from zero_fx.plan.offline import language_model_loss

    join_spawned_group(rank, world, port)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=64,
                          bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, x, y):
        loss = language_model_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    passes = [zero_fx.after("check_invariants", outline_repeated_runs)] if regional else []
    compiled = zero_fx.zero_compile(step, stage=3, backend="inductor", passes=passes,
                                    pin_schedule=not regional, persistence_threshold=0)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
    y = torch.roll(x, -1, dims=1)
    start = time.perf_counter()
    losses = [compiled(model, opt, x, y).item()]
    first = time.perf_counter() - start
    losses += [compiled(model, opt, x, y).item() for _ in range(3)]
    dist.destroy_process_group()
    if rank == 0:
        out.put((first, losses))


def measure(layers: int, regional: bool) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the ranks inherit it: a cold compile
        out = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_rank, args=(2, free_port(), layers, regional, out), nprocs=2,
                           start_method="spawn")
        return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    print("| layers | whole graph | outlined | ratio | largest loss difference |\n|---|---|---|---|---|")
    for layers in args.layers:
        whole, outlined = measure(layers, False), measure(layers, True)
        difference = max(abs(a - b) for a, b in zip(whole[1], outlined[1]))
        print(f"| {layers} | {whole[0]:.1f} s | {outlined[0]:.1f} s | {outlined[0] / whole[0]:.2f} | "
              f"{difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
