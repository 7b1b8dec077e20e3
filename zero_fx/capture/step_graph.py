"""Capture: dynamo's graph of the step -> one aten graph of forward + backward.

[Note: capturing the step]
With ``trace_autograd_ops``, dynamo records ``loss.backward()`` as
``torch.autograd.grad`` plus, for each parameter, ``empty_like(p).copy_(g)``
returned as a graph output that dynamo then assigns to ``p.grad``. zero_fx
swaps ``opt.step`` and ``opt.zero_grad`` for no-ops during the trace (they run
on the shards after the graph), and detaches what the step returns, so the
whole step is a single graph. ``make_fx`` traces that graph on fake tensors,
which runs the autograd engine and records the backward as plain aten ops
after the forward. Finally each ``copy_(empty_like(p), g)`` output is replaced
by ``g`` itself and recorded as the gradient of ``p``: the graph is then
functional, with parameters as placeholders and gradients as outputs.
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Optional, Sequence

import torch
from torch.fx import GraphModule
from torch.fx.node import map_aggregate
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from ..passes.common.predicates import CAPTURED_AT_META, GRAD_SLOTS_META, PARAM_META
from .accumulated_gradients import sum_accumulated_gradients
from ..passes.common.splice import outside_dynamo_tracing, trace_to_aten
from .dtensors import local_tensor
from .errors import CaptureError
from .inline_checkpoints import inline_checkpoints
from .layout_decompositions import layout_safe_decompositions
from .kept_captures import capture_key, keep_capture, kept_capture
from .scalar_outputs import items_as_tensors
from .tensor_parallel import (has_dtensors, mark_tensor_parallel, over_local_tensors,
                              sum_partials_before_reducing)

aten = torch.ops.aten

CHECKPOINTED_META = "zero_checkpointed"
"""GraphModule meta key: how many ``torch.utils.checkpoint`` regions the model had
([Note: torch.utils.checkpoint in a captured step] in inline_checkpoints.py)."""


BACKWARD_WITHOUT_OPTIMIZER = (
    "{step} calls loss.backward() but takes no optimizer: a step without one is an evaluation "
    "step, forward only. To train, pass the optimizer as an argument (or name it with "
    "@zero_compile(optimizer=...)); to evaluate, drop the backward")


def capture_step_graph(
    dynamo_gm: GraphModule, example_inputs: Sequence, param_names: Sequence[Optional[str]],
    key: Optional[Hashable], forward_only: bool = False,
) -> GraphModule:
    """One functional aten graph of the step, parameters tagged, gradients as outputs.

    ``param_names[i]`` is the plan name of graph input ``i`` if it is a model
    parameter, else None. ``forward_only``: an evaluation step, which must compute no
    gradient ([Note: evaluation steps] in zero_fx/evaluation.py). ``key``: what
    ``capture_key_of`` gave for this graph, which it must be given first (it also rewrites
    the graph's ``.item()`` calls).
    """
    if (kept := kept_capture(key)) is not None:  # [Note: kept captures]
        return kept
    checkpointed = inline_checkpoints(dynamo_gm)
    gm = _trace(dynamo_gm, example_inputs)
    gm.meta[CHECKPOINTED_META] = checkpointed
    if mark_tensor_parallel(gm):
        sum_partials_before_reducing(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = [n.name for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    for node, name, source in zip(placeholders, param_names, sources):
        if name is not None:
            node.meta[PARAM_META] = name
        _name_readably(node, name.replace(".", "_") if name else _user_name(source))
    _fold_static_sizes(gm)
    sum_accumulated_gradients(gm)  # [Note: several backward calls in one step]
    gm.meta[GRAD_SLOTS_META] = _gradients_as_outputs(gm)
    if forward_only and gm.meta[GRAD_SLOTS_META]:
        raise CaptureError(BACKWARD_WITHOUT_OPTIMIZER.format(step="the step"))
    if not gm.meta[GRAD_SLOTS_META] and not forward_only:
        raise CaptureError(
            "the step computed no parameter gradient: call loss.backward() inside the "
            "function decorated with @zero_compile"
        )
    gm.graph.eliminate_dead_code()
    for position, node in enumerate(gm.graph.nodes):
        node.meta[CAPTURED_AT_META] = position  # [Note: in-place writes keep their readers' sides]
    gm.graph.lint()
    gm.recompile()
    keep_capture(key, gm)
    return gm


def capture_key_of(dynamo_gm: GraphModule, example_inputs: Sequence,
                   param_names: Sequence[Optional[str]]) -> Optional[Hashable]:
    """What decides the capture of ``dynamo_gm`` ([Note: kept captures]); None where the step
    is captured every time (dynamic shapes, calls of other Python code)."""
    items_as_tensors(dynamo_gm)  # [Note: .item() as a graph output]
    if has_dynamic_shapes(dynamo_gm):
        return None
    return capture_key(dynamo_gm, example_inputs, param_names)


def _trace(dynamo_gm: GraphModule, example_inputs: Sequence) -> GraphModule:
    """``make_fx`` of dynamo's graph on fakes: forward and backward as aten ops (over the
    local tensors of a tensor-parallel model's DTensors: [Note: capturing a tensor-parallel
    step] in tensor_parallel.py).

    [Note: RNNs in the step]
    Dynamo traces ``nn.LSTM``/``nn.GRU`` with ``allow_rnn`` (compiled_step.DYNAMO_CONFIG), and
    make_fx decomposes ``aten.lstm``. On the CPU, with oneDNN enabled, the decomposition picks
    ``aten.mkldnn_rnn_layer`` and its backward (the input does not require grad below
    autograd, where make_fx traces), whose ``workspace`` output then arrives undefined at
    the backward once AOTAutograd traces the rewritten graph again (aot_eager, Inductor:
    "Expected a proper Tensor but got None ... 'workspace'"; the graph as traced runs). With
    oneDNN off while tracing, the decomposition is the plain cell (matmuls, sigmoid, tanh),
    which every backend compiles. Only the trace is affected: the compiled kernels' own
    choice of oneDNN at run time is not.
    """
    step = dynamo_gm
    if has_dtensors(example_inputs):
        if has_dynamic_shapes(dynamo_gm):
            raise CaptureError("a tensor-parallel model (DTensor parameters) with dynamic shapes "
                               "is not supported yet: feed batches of one shape (no "
                               "torch._dynamo.mark_dynamic)")
        step = over_local_tensors(dynamo_gm, example_inputs)
        example_inputs = [local_tensor(v) for v in example_inputs]
    if has_dynamic_shapes(dynamo_gm):
        # [Note: dynamic shapes]
        # Traced on fakes of dynamo's own fake mode, whose symbolic sizes have
        # sources: whatever the trace, our passes or lowering assume about a
        # size becomes one of dynamo's guards, checked on every call.
        # The Python dispatcher, as make_fx's symbolic tracing enters it: without it torch
        # 2.11's C++ linear reads a symbolic size as an int, and the graph fits one length
        # ([Note: what differs between torch releases] in zero_fx/base/compat.py).
        fakes = fakes_like_dynamo(example_inputs)
        with torch._guards.TracingContext.get().fake_mode, onednn_off(), \
                enable_python_dispatcher():
            return trace_to_aten(step, decompositions=layout_safe_decompositions())(*fakes)
    # A fresh fake mode with static shapes, outside dynamo's tracing context:
    # anything our passes compute on shapes must not become a dynamo guard.
    # [Note: RNNs in the step]: no oneDNN RNN layers in the graph
    with outside_dynamo_tracing(), onednn_off():
        fake_mode = FakeTensorMode()
        fakes = static_fakes(example_inputs, fake_mode)
        with fake_mode:
            return trace_to_aten(step, decompositions=layout_safe_decompositions())(*fakes)


@contextlib.contextmanager
def onednn_off():
    """oneDNN off inside ([Note: RNNs in the step]), its other flags untouched:
    ``torch.backends.mkldnn.flags`` writes TF32's back too, which on builds without Intel GPU
    support warns ("TF32 acceleration on top of oneDNN is available for Intel GPUs") once per
    process, at the user's first call."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def static_fakes(values: Sequence, fake_mode: FakeTensorMode) -> list:
    """Fakes of ``fake_mode`` with every size static; non-tensors pass through."""
    return [fake_mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v
            for v in values]


def fakes_like_dynamo(values: Sequence) -> list:
    """Fakes of dynamo's current fake mode: a tensor dynamo traced keeps its symbolic sizes,
    any other (a shard) is static; non-tensors pass through."""
    context = torch._guards.TracingContext.get()
    fakes = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            fakes.append(value)
        elif value in context.tensor_to_context:
            symbolic = context.tensor_to_context[value]
            fakes.append(context.fake_mode.from_tensor(
                value, symbolic_context=symbolic, source=symbolic.tensor_source, trace=False))
        else:
            fakes.extend(static_fakes([value], context.fake_mode))
    return fakes


def has_dynamic_shapes(dynamo_gm: GraphModule) -> bool:
    """Some value of dynamo's graph has a symbolic size: an input's (``torch._dynamo.
    mark_dynamic``, or a size that changed: [Note: one dynamic graph for every length] in
    dynamic_shapes.py), or one the data decides (``x[mask]``), which only dynamo's fake mode
    can trace."""
    for node in dynamo_gm.graph.nodes:
        value = node.meta.get("example_value")
        shape = value.shape if isinstance(value, torch.Tensor) else (value,)
        if any(isinstance(size, torch.SymInt) for size in shape):
            return True
    return False


def _name_readably(placeholder: torch.fx.Node, name: str) -> None:
    """``arg3_1`` becomes ``h_0_attn_weight`` (a parameter) or ``x`` (the step's argument
    ``x``): graph dumps and generated code then say what each input is."""
    placeholder._rename(name)
    placeholder.target = placeholder.name


def _user_name(dynamo_name: str) -> str:
    """Dynamo names the step's argument ``x`` ``l_x_``."""
    name = dynamo_name.removeprefix("l_").removeprefix("L_").removesuffix("_")
    return name if name.isidentifier() else dynamo_name


def _gradients_as_outputs(gm: GraphModule) -> dict[int, str]:
    """Replace ``copy_(empty_like(param), grad)`` outputs by ``grad``; map output index -> name."""
    output = gm.graph.output_node()
    outs = list(output.args[0])
    slots: dict[int, str] = {}
    for index, out in enumerate(outs):
        if not (isinstance(out, torch.fx.Node) and out.target == aten.copy_.default):
            continue
        dest, grad = out.args[0], out.args[1]
        if dest.target != aten.empty_like.default or PARAM_META not in dest.args[0].meta:
            continue
        name = dest.args[0].meta[PARAM_META]
        readers = [user for user in out.users if user.op != "output"]
        if readers:
            raise CaptureError(
                f"the step reads or changes the gradient of {name} between loss.backward() and "
                f"opt.step() ({readers[0].target}); zero_fx reduces (and shards) gradients across "
                "ranks where the backward produces them, so code there would see unreduced "
                "values. To clip, call torch.nn.utils.clip_grad_norm_ / clip_grad_value_ "
                "(by that name, or a name the step's own module imports) on model.parameters(), "
                "which zero_fx runs on the reduced gradients, or use "
                "zero_compile(max_grad_norm=...) (the norm is step.last_grad_norm); to "
                "accumulate, zero_compile(accumulation_steps=...)")
        if name in slots.values():
            raise CaptureError(f"parameter {name} received two gradient outputs that capture "
                               "could not sum into one; zero_fx reduces one gradient per "
                               "parameter")
        slots[index] = name
        outs[index] = grad
        output.args = (tuple(outs),)
        gm.graph.erase_node(out)
        gm.graph.erase_node(dest)
    return slots


def _fold_static_sizes(gm: GraphModule) -> None:
    """Replace ``sym_size`` nodes whose value is a plain int by that int.

    Left in place, a backward ``sym_size(weight)`` would count as a use of the
    parameter and cost a gather just to read a shape.
    """
    for node in list(gm.graph.nodes):
        if node.target == aten.sym_size.int and isinstance(node.meta.get("val"), int):
            size = node.meta["val"]
            for user in list(node.users):
                user.args = map_aggregate(user.args, lambda a: size if a is node else a)
                user.kwargs = map_aggregate(user.kwargs, lambda a: size if a is node else a)
            gm.graph.erase_node(node)
