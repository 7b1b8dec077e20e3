"""Steps that cannot be one graph fail, with on_graph_break="error", with a CaptureError that
says what to change (by default they run eagerly: tests/test_graph_breaks.py)."""

import types

import pytest
import torch

from support import models
from support.ranks import run_ranks
from support.training import check_updates
from zero_fx import CaptureError, zero_compile


def branches_on_a_value(model, opt, x, y):
    loss = models.loss_fn("mlp", model, x, y)
    if loss.item() > 100:
        loss = loss * 0
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _capture_error(rank, world_size, step_fn, model_name="mlp", loss_type="unchanged"):
    model = models.build(model_name)
    if loss_type != "unchanged":
        model.loss_type = loss_type
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(step_fn, stage=3, backend="aot_eager", on_graph_break="error")
    x, y = models.global_batch(model_name, 0)
    try:
        step(model, opt, x, y)
    except CaptureError as err:
        return str(err)
    return "no error"


# A boolean mask's selection (`model(x)[y > 0]`) captures: its size is a symbol of dynamo's
# shape environment (test_step_shapes.py trains a masked loss at parity).
@pytest.mark.parametrize("step_fn, advice", [
    (branches_on_a_value, "use `torch.where`"),
])
def test_the_error_names_the_fix(step_fn, advice):
    message = run_ranks(1, _capture_error, step_fn)[0]
    assert message.startswith("zero_fx captures the whole step as one graph, and PyTorch could not")
    assert advice in message


def _logged_during_two_calls(rank, world_size):
    """An HF model whose loss warns from inside the step (``loss_type`` unset, as from
    ``from_config``): what its logger received over two calls."""
    import logging

    model = models.build("hf_gpt2")
    model.loss_type = None
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    step = zero_compile(models.training_step("hf_gpt2"), stage=3, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for call in range(2):
        step(model, opt, *models.global_batch("hf_gpt2", call))
    return [record.getMessage() for record in records]


def test_a_hf_model_that_logs_in_its_loss_trains_and_logs_once():
    """Its ``logger.warning_once`` runs after the graph ([Note: host effects after the
    graph]), once: the first call's, deduplicated by transformers as in eager."""
    pytest.importorskip("transformers")
    messages = run_ranks(1, _logged_during_two_calls)[0]
    assert len([m for m in messages if "loss_type=None" in m]) == 1, messages


def routes_to_experts(model, opt, x, y):
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


class SigmoidRoutedExperts(torch.nn.Module):
    """An MoE block that loops over the experts that received tokens, as HF Mixtral's does,
    but routes by sigmoid scores: a routing the rewrite does not know, so the block is left
    as it is and its data-dependent loop does not capture."""

    def __init__(self, hidden=16, num_experts=4, top_k=2):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden)
                                           for _ in range(num_experts))
        self.top_k = top_k

    def forward(self, x):
        weights, chosen = torch.sigmoid(self.gate(x)).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            rows = self.experts[expert_idx](x[top_x]) * weights[top_x, idx, None]
            out = out.index_add(0, top_x, rows)
        return out


class SigmoidRoutedMoE(torch.nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.embed = torch.nn.Embedding(models.VOCAB, hidden)
        self.moe = SigmoidRoutedExperts(hidden)
        self.head = torch.nn.Linear(hidden, models.VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids).flatten(0, 1)
        logits = self.head(x + self.moe(x))
        loss = torch.nn.functional.cross_entropy(logits, labels.flatten())
        return types.SimpleNamespace(loss=loss)


def _unrecognised_moe_capture_error(rank, world_size):
    torch.manual_seed(0)
    model = SigmoidRoutedMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(routes_to_experts, stage=3, backend="aot_eager", on_graph_break="error")
    x, y = models.global_batch("gpt", 0)
    try:
        step(model, opt, x, y)
    except CaptureError as err:
        return str(err), step.moe_blocks
    return "no error", step.moe_blocks


def test_a_mixture_of_experts_loop_zero_fx_does_not_rewrite_is_named():
    """A block shaped like a mixture of experts whose routing no fixed-shape form reproduces
    is left alone; its data-dependent loop then fails to capture, and the error names it."""
    message, rewritten = run_ranks(1, _unrecognised_moe_capture_error)[0]
    assert rewritten == []
    assert "Could not extract specialized integer from data-dependent expression" in message
    assert "for expert_idx in expert_hit" in message  # dynamo's "Caused by" line is kept
    assert ("module 'moe' (SigmoidRoutedExperts) looks like a mixture-of-experts block, but none of the "
            "fixed-shape forms") in message, message
    assert "zero_fx captures a mixture-of-experts block that holds its experts" in message
    assert "A fixed-shape routing layer captures" in message
    assert "User Stack" not in message and len(message.splitlines()) < 12, message


class DenseMoE(torch.nn.Module):
    """The fixed-shape routing the MoE hint suggests: every expert runs on every token,
    weighted by the router's top-2 weights (zero where a token did not pick the expert)."""

    def __init__(self, hidden=16, experts=4, top=2):
        super().__init__()
        self.embed = torch.nn.Embedding(models.VOCAB, hidden)
        self.router = torch.nn.Linear(hidden, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))
        self.head = torch.nn.Linear(hidden, models.VOCAB)
        self.top = top

    def forward(self, ids):
        x = self.embed(ids)
        weights, picked = torch.softmax(self.router(x), -1).topk(self.top, -1)
        gates = torch.zeros_like(self.router(x)).scatter(-1, picked, weights)
        x = x + sum(gates[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        return self.head(x)


def test_a_fixed_shape_routing_layer_captures_and_trains_like_eager():
    def step_fn(model, opt, x, y):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    model, reference = DenseMoE(), DenseMoE()
    reference.load_state_dict(model.state_dict())
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opt, reference_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zero_compile(step_fn, stage=3, backend="aot_eager", on_graph_break="error")
    for i in range(3):
        x, y = models.global_batch("gpt", i)
        assert torch.allclose(step(model, opt, x, y), step_fn(reference, reference_opt, x, y),
                              rtol=1e-6)
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    check_updates([{"params": step.full_parameters()}], {"params": expected, "initial": initial},
                  1e-5)  # each parameter's update error: measured 0 (one rank, eager's ops)


class SlicedExperts(torch.nn.Module):
    """Experts as one 3-D parameter, each run on rows sliced at offsets the data decides
    (HuggingFace Aria's sequential GEMM)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x, counts):
        ends = torch.cumsum(counts, 0)
        out = torch.zeros_like(x)
        start = torch.zeros((), dtype=torch.long)
        for e in range(2):
            out[start:ends[e]] = x[start:ends[e]] @ self.weight[e]
            start = ends[e]
        return out


def test_a_size_the_data_decides_in_the_backward_is_a_capture_error_with_advice():
    """PyTorch's tracer fails inside (InternalTorchDynamoError, PendingUnbackedSymbolNotFound)
    on such slices: a CaptureError that says what it is and what to do, not the tracer's
    internals."""
    def step(model, opt, x, counts):
        loss = model(x, counts).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model = SlicedExperts()
    compiled = zero_compile(step, stage=0, backend="aot_eager")
    with pytest.raises(CaptureError, match="A size the data decides reaches the backward"):
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(6, 8),
                 torch.tensor([2, 4]))


def test_transformers_fallback_backward_of_its_grouped_matmul_is_named_before_the_generic_advice():
    """transformers 5.17-5.23 on a device without grouped_mm (Mixtral on a CPU, in fp32 on a
    GPU): the failure PyTorch reports is a data-dependent guard, as a value-branching step's,
    but the way out is an upgrade, not a change to the user's step (PyTorch's message, as met
    with transformers 5.20 and torch 2.14)."""
    from torch._dynamo.exc import UserError, UserErrorType
    from zero_fx.capture.hints import capture_failed

    message = ("Could not guard on data-dependent expression Eq(u1, 0) (unhinted: Eq(u1, 0)).\n"
               "Caused by: loss.backward()  # tests/support/models.py:287 in language_model_step "
               "(transformers/integrations/moe.py:246 in _grouped_mm_fallback_backward)")
    error = str(capture_failed(UserError(UserErrorType.CONSTRAINT_VIOLATION, message)))
    assert "transformers>=5.24" in error and "torch.where" not in error
