"""Captures kept for the process: a dynamo graph compiled again is not traced again.

[Note: kept captures]
A step is compiled again with the same dynamo graph more often than it seems: a second
``zero_compile`` of the same model with other options (bench's comparisons, a test grid),
the same step after ``torch._dynamo.reset()``, a step function used for two models of one
shape. Capturing (make_fx of the forward and the autograd engine's backward on fakes) is
then the same work with the same result: about 0.6 s of a small GPT's 1.4 s compile, and
552 of the 870 compilations of this project's test suite repeated a dynamo graph their
process had already captured.

So ``capture_step_graph`` keeps each capture and hands a later compilation of the same
graph a copy: its own nodes, which the passes rewrite, whose ``meta["val"]`` are the kept
fake values (fake tensors are only read; a pass that sets a value sets a new one), and
which names it has given, so that a pass names new nodes in a copy as in the traced graph
(ranks compare their graphs, names included, and one rank may trace what another kept).
The graph of a capture is decided by:
- dynamo's code, its submodules' too (the model's code is inlined into torch calls there);
- the functions that code calls, by identity (a patched torch function is another one).
  Only torch's own and Python's operators are taken: a graph that calls other Python code
  (``allow_in_graph``) is captured every time, as is one holding tensor constants;
- each input's layout (sizes, strides, offset, dtype, device, requires_grad, type, which
  earlier input shares its storage) and the plan names of the parameters;
- what the process may change between compilations: grad mode, the default dtype,
  deterministic algorithms, autocast, the attention kernels ``scaled_dot_product_attention``
  may choose (``sdpa_kernel``: a flash-only step once took a kept capture that had chosen
  the memory-efficient kernel, met on a GPU).
Steps with symbolic sizes or DTensor parameters are captured every time: their capture
depends on dynamo's fake mode and the device mesh. The process keeps at most
``KEPT_CAPTURES``, dropping the least recently used first.
"""

from __future__ import annotations

import collections
import copy
from typing import Hashable, Optional, Sequence

import torch
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _make_graph_module

from ..passes.common.splice import static_layout

KEPT_CAPTURES = 32
"""How many distinct captures the process keeps (a few graphs of thousands of nodes each)."""

_kept: "collections.OrderedDict[Hashable, GraphModule]" = collections.OrderedDict()

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_VALUE_TYPES = (int, float, bool, type(None))


def capture_key(dynamo_gm: GraphModule, example_inputs: Sequence,
                param_names: Sequence[Optional[str]]) -> Optional[Hashable]:
    """What decides the capture of ``dynamo_gm`` on ``example_inputs`` ([Note: kept
    captures]); None where that is not all, and the step is captured every time."""
    code, targets = [], []
    for name, module in dynamo_gm.named_modules():
        if not isinstance(module, GraphModule) or _holds_tensors(module):
            return None
        code.append((name, module.code))
        for node in module.graph.nodes:
            if node.op == "call_function":
                if not _is_torch_or_operator(node.target):
                    return None
                targets.append(node.target)
    inputs = _input_layouts(example_inputs)
    if inputs is None:
        return None
    key = (tuple(code), tuple(targets), inputs, tuple(param_names), _process_state())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def capture_parts(key: Hashable) -> dict[str, str]:
    """What decides a capture (``capture_key``'s key), as text another process reads alike:
    functions by their qualified names, not their identities ([Note: saved steps] in
    zero_fx/compiler/saved_steps.py)."""
    code, targets, inputs, param_names, process = key
    return {"the step's code": repr(code) + repr([_qualified_name(t) for t in targets]),
            "the inputs' shapes and dtypes": repr(inputs) + repr(param_names),
            "grad mode, autocast and attention kernels": repr(process)}


def has_kept(key: Optional[Hashable]) -> bool:
    """The process keeps a capture under ``key``."""
    return key is not None and key in _kept


def kept_capture(key: Optional[Hashable]) -> Optional[GraphModule]:
    """A copy of its own of the capture kept under ``key``; None if there is none."""
    if key is None or key not in _kept:
        return None
    _kept.move_to_end(key)
    return _copy(_kept[key])


def keep_capture(key: Optional[Hashable], gm: GraphModule) -> None:
    """Keeps a copy of ``gm`` (about to be rewritten) under ``key``."""
    if key is None:
        return
    _kept[key] = _copy(gm)
    if len(_kept) > KEPT_CAPTURES:
        _kept.popitem(last=False)


def forget_captures() -> None:
    """Drop every kept capture (``torch._dynamo.reset()`` does not reach them)."""
    _kept.clear()


def _copy(gm: GraphModule) -> GraphModule:
    """``gm`` with nodes of its own; their metadata entries (fake values) are shared."""
    graph = copy.deepcopy(gm.graph)  # Graph's deepcopy: new nodes, each meta dict copied
    # The names a pass's new nodes get depend on every name the graph ever gave, erased
    # nodes' too, which a copy does not see: without them a copy names new nodes other
    # than a fresh trace would, and ranks that compare graphs (rank_agreement) disagree.
    names, traced_names = graph._graph_namespace, gm.graph._graph_namespace
    names._used_names = set(traced_names._used_names)
    names._base_count = dict(traced_names._base_count)
    # lazy: [Note: graph modules that generate their code when it is used] in compiler/backend.py
    copied = _make_graph_module(gm, graph, class_name=gm.__class__.__name__)
    copied.meta = {key: copy.copy(value) for key, value in gm.meta.items()}
    return copied


def _holds_tensors(module: GraphModule) -> bool:
    return (any(True for _ in module.parameters(recurse=False))
            or any(True for _ in module.buffers(recurse=False))
            or any(isinstance(value, torch.Tensor) for value in vars(module).values()))


def _qualified_name(target) -> str:
    return f"{getattr(target, '__module__', None)}.{getattr(target, '__qualname__', repr(target))}"


def _is_torch_or_operator(target) -> bool:
    module = getattr(target, "__module__", None) or ""
    return (module == "torch" or module.startswith("torch.")
            or module in ("_operator", "operator", "builtins", "math"))


def _input_layouts(example_inputs: Sequence) -> Optional[tuple]:
    layouts, storages = [], {}
    for index, value in enumerate(example_inputs):
        if type(value) in _PLAIN_VALUE_TYPES:
            layouts.append((type(value), value))
            continue
        if type(value) not in _PLAIN_TENSOR_TYPES or value.layout != torch.strided:
            return None  # a subclass (DTensor, a fake), a symbolic size, a sparse tensor
        layout = static_layout(value)
        if layout is None:
            return None
        shares = storages.setdefault(value.untyped_storage()._cdata, index)
        layouts.append((layout, type(value), shares))
    return tuple(layouts)


def _process_state() -> tuple:
    return (torch.is_grad_enabled(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(),
            tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                  for device in ("cpu", "cuda")),
            _attention_kernels())


def _attention_kernels() -> tuple:
    """Which fused attention kernels ``scaled_dot_product_attention`` may choose, and in what
    order: the capture records the one chosen (``sdpa_kernel(...)`` around a step picks it)."""
    backends = torch.backends.cuda
    enabled = (backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
               backends.math_sdp_enabled(), backends.cudnn_sdp_enabled())
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    return enabled + (tuple(order()) if order is not None else ())
