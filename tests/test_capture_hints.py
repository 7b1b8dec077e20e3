"""Steps that cannot be one graph fail with a CaptureError that says what to change."""

import pytest
import torch

import models
from ranks import run_ranks
from zero_fx import CaptureError, zero_compile


def branches_on_a_value(model, opt, x, y):
    loss = models.loss_fn("mlp", model, x, y)
    if loss.item() > 100:
        loss = loss * 0
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def selects_with_a_mask(model, opt, x, y):
    loss = model(x)[y > 0].pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _capture_error(rank, world_size, step_fn, model_name="mlp", loss_type="unchanged"):
    model = models.build(model_name)
    if loss_type != "unchanged":
        model.loss_type = loss_type
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(step_fn, stage=3, backend="aot_eager")
    x, y = models.global_batch(model_name, 0)
    try:
        step(model, opt, x, y)
    except CaptureError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("step_fn, advice", [
    (branches_on_a_value, "use `torch.where`"),
    (selects_with_a_mask, "Use a fixed-shape form"),
])
def test_the_error_names_the_fix(step_fn, advice):
    message = run_ranks(1, _capture_error, step_fn)[0]
    assert message.startswith("zero_fx captures the whole step as one graph, and PyTorch could not")
    assert advice in message


def test_a_logging_hf_model_says_what_to_set():
    pytest.importorskip("transformers")
    # loss_type None, as a model from from_config / from_pretrained comes: its loss logs
    message = run_ranks(1, _capture_error, models.training_step("hf_gpt2"), "hf_gpt2", None)[0]
    assert "logging.Logger" in message
    assert 'model.loss_type = "ForCausalLM"' in message


def routes_to_experts(model, opt, x, y):
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _mixtral_capture_error(rank, world_size):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=models.VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(config)
    model.loss_type = "ForCausalLM"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(routes_to_experts, stage=3, backend="aot_eager")
    x, y = models.global_batch("gpt", 0)
    try:
        step(model, opt, x, y)
    except CaptureError as err:
        return str(err)
    return "no error"


def test_a_mixture_of_experts_loop_says_to_route_with_fixed_shapes():
    """HF Mixtral loops over the experts that received tokens (a data-dependent count)."""
    pytest.importorskip("transformers")
    message = run_ranks(1, _mixtral_capture_error)[0]
    assert "Could not extract specialized integer from data-dependent expression" in message
    assert "for expert_idx in expert_hit" in message  # dynamo's "Caused by" line is kept
    assert "A fixed-shape routing layer captures" in message
    assert "User Stack" not in message and len(message.splitlines()) < 10, message


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
    opt, reference_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zero_compile(step_fn, stage=3, backend="aot_eager")
    for i in range(3):
        x, y = models.global_batch("gpt", i)
        assert torch.allclose(step(model, opt, x, y), step_fn(reference, reference_opt, x, y),
                              rtol=1e-6)
