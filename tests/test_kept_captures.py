"""Kept captures ([Note: kept captures] in zero_fx/capture/kept_captures.py): a dynamo graph
compiled again is not traced again, each compilation rewrites a graph of its own, and
whatever decides a capture is part of its key."""

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch._subclasses.fake_tensor import FakeTensorMode

from test_api import standard_step, tiny
from zero_fx import zero_compile
from zero_fx.capture import kept_captures, step_graph
from zero_fx.capture.kept_captures import capture_key


@pytest.fixture(autouse=True)
def traces(monkeypatch):
    """Counts the captures traced (not taken from the kept ones), from none kept."""
    monkeypatch.setattr(kept_captures, "_kept", type(kept_captures._kept)())
    traced = []
    trace = step_graph._trace

    def counted(dynamo_gm, example_inputs):
        traced.append(len(example_inputs))
        return trace(dynamo_gm, example_inputs)

    monkeypatch.setattr(step_graph, "_trace", counted)
    return traced


def train(step, model, opt, batch_size=3, steps=3):
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(batch_size, 4), torch.randn(batch_size, 2)
        losses.append(step(model, opt, x, y).item())
    return losses


def test_a_step_compiled_again_takes_the_kept_capture_and_trains_like_eager(traces):
    """Two zero_compile steps of one model shape, with other options (a second optimizer,
    gradients in buckets of their own): the second is not traced, and both train as eager
    PyTorch does (bitwise, as measured: one rank runs eager's ops)."""
    first_model, second_model, reference = tiny(), tiny(), tiny()
    first = zero_compile(standard_step, backend="eager")
    second = zero_compile(standard_step, backend="eager", bucket_bytes=64)
    first_losses = train(first, first_model, torch.optim.SGD(first_model.parameters(), lr=0.1))
    second_losses = train(second, second_model,
                          torch.optim.SGD(second_model.parameters(), lr=0.1))
    assert len(traces) == 1
    expected = train(standard_step, reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    assert first_losses == second_losses == expected
    full = second.full_parameters()
    for name, p in reference.named_parameters():
        assert torch.equal(full[name], p), name
    # the kept capture is as traced: neither compilation's passes rewrote it
    (kept,) = kept_captures._kept.values()
    graphs = {id(g.graph) for g in (first.graphs + second.graphs)}
    assert id(kept.graph) not in graphs
    assert len(kept.graph.nodes) < min(len(g.graph.nodes) for g in first.graphs + second.graphs)


def test_another_batch_shape_is_traced_anew(traces):
    model = tiny()
    step = zero_compile(standard_step, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(step, model, opt, batch_size=3, steps=1)
    train(step, model, opt, batch_size=5, steps=1)
    assert len(traces) == 2


def linear(x, w):
    return F.linear(x, w).sum()


def key(fn=linear, inputs=None, names=("x", "w")):
    inputs = inputs if inputs is not None else (torch.randn(3, 4), torch.randn(2, 4))
    return capture_key(torch.fx.symbolic_trace(fn), inputs, names)


def test_the_key_is_the_code_the_inputs_layouts_the_names_and_the_process_state():
    x, w = torch.randn(3, 4), torch.randn(2, 4)
    assert key() is not None and key() == key(inputs=(x, w))
    others = {
        "shape": key(inputs=(torch.randn(5, 4), w)),
        "strides": key(inputs=(torch.randn(4, 3).t(), w)),
        "dtype": key(inputs=(x.double(), w.double())),
        "requires_grad": key(inputs=(x, w.clone().requires_grad_())),
        "a parameter": key(inputs=(x, nn.Parameter(w.clone()))),
        "a shared storage": key(inputs=(x, x[:2])),
        "names": key(names=("x", "weight")),
        "code": key(fn=lambda x, w: F.linear(x, w).mean()),
    }
    with torch.no_grad():
        others["grad mode"] = key()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        others["default dtype"] = key()
    finally:
        torch.set_default_dtype(previous)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        others["autocast"] = key()
    with sdpa_kernel(SDPBackend.MATH):
        others["the attention kernels"] = key()
    for what, other in others.items():
        assert other is not None and other != key(), what


@torch.fx.wrap
def python_helper(x):
    return x * 2


def test_what_the_key_cannot_hold_is_captured_every_time():
    """Python code of the user's in the graph, a tensor constant, a subclass input (a fake
    here, a DTensor in a tensor-parallel step) or a non-tensor object: no key."""
    assert key(fn=lambda x, w: python_helper(F.linear(x, w)).sum()) is None
    constant = torch.fx.symbolic_trace(linear)
    constant.register_buffer("scale", torch.ones(1))
    assert capture_key(constant, (torch.randn(3, 4), torch.randn(2, 4)), ("x", "w")) is None
    with FakeTensorMode() as mode:
        fakes = (mode.from_tensor(torch.randn(3, 4)), mode.from_tensor(torch.randn(2, 4)))
    assert key(inputs=fakes) is None
    assert key(inputs=(torch.randn(3, 4), object())) is None


def test_the_process_keeps_a_bounded_number(monkeypatch):
    monkeypatch.setattr(kept_captures, "KEPT_CAPTURES", 2)
    gm = torch.fx.symbolic_trace(linear)
    for rows in (1, 2, 3):
        kept_captures.keep_capture(key(inputs=(torch.randn(rows, 4), torch.randn(2, 4))), gm)
    assert len(kept_captures._kept) == 2
    assert kept_captures.kept_capture(key(inputs=(torch.randn(1, 4), torch.randn(2, 4)))) is None
    copy = kept_captures.kept_capture(key(inputs=(torch.randn(3, 4), torch.randn(2, 4))))
    assert copy is not None and copy.graph is not gm.graph
    assert [n.name for n in copy.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_a_copy_names_new_nodes_as_the_traced_graph_would():
    """Names once given stay taken after their node is erased (capture erases the gradients'
    copies): a copy that forgot them would name a pass's nodes otherwise than the rank that
    traced, and ranks comparing graphs would disagree."""
    gm = torch.fx.symbolic_trace(lambda x: (x + 1) + 2)
    first = next(n for n in gm.graph.nodes if n.name == "add")
    with gm.graph.inserting_after(first):
        spare = gm.graph.call_function(torch.neg, (first,))
    gm.graph.erase_node(spare)
    kept_captures.keep_capture(key(fn=linear), gm)
    copy = kept_captures.kept_capture(key(fn=linear))
    made = [g.graph.call_function(torch.neg, (next(iter(g.graph.nodes)),)).name
            for g in (gm, copy)]
    assert made[0] == made[1] == "neg_1"


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 4, 3, 2, 4).unbind(2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attention_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def test_a_step_under_another_attention_kernel_is_traced_anew(traces):
    """``sdpa_kernel`` decides which kernel the capture records: a step compiled under the
    math kernel after one under flash takes no kept capture, and runs the kernel it asked for."""
    kernels = {}
    for backend, op in ((SDPBackend.FLASH_ATTENTION,
                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default),
                        (SDPBackend.MATH, torch.ops.aten.bmm.default)):
        torch.manual_seed(0)
        model = _Attention()
        step = zero_compile(_attention_step, backend="eager")
        with sdpa_kernel(backend):
            step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4, 8))
        targets = {n.target for gm in step.graphs for n in gm.graph.nodes}
        kernels[backend] = op in targets
    assert len(traces) == 2
    assert kernels == {SDPBackend.FLASH_ATTENTION: True, SDPBackend.MATH: True}
