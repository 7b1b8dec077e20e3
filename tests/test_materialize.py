"""Models built on the meta device (zero_fx/materialize): materialized one module at a time, they
equal the model built normally under the same seed (values, ties, buffers and the random stream
after), train with parity against single-process training, and anything zero_fx cannot
reproduce is an error that names it."""

import importlib.util

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from support import models
from examples.gpt import GPT, GPTConfig
from support.training import parity_errors, reference_run, zero_fx_run
from zero_fx import MaterializeError, zero_compile
from zero_fx.materialize import materialize
from zero_fx.plan import PlanOptions, PlanRanks, plan_for_module

GPT_CONFIG = GPTConfig(vocab_size=models.VOCAB, block_size=models.SEQ, n_layer=2, n_head=2,
                       n_embd=32, bias=True)


def materialized(build, stage: int, init_fn=None, seed: int = 0):
    """(the model built normally, the meta model materialized at world size 1, each one's
    parameters as the optimizer would hold them, and the next random draw after each)."""
    torch.manual_seed(seed)
    built = build()
    after_built = torch.rand(4)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build()
    masters = materialize(model, plan_for_module(model, PlanRanks(1), PlanOptions(stage=stage)), init_fn=init_fn)
    after = torch.rand(4)
    params = {name: masters[name].view(p.shape) if masters is not None else p
              for name, p in model.named_parameters()}
    return built, model, params, (after_built, after)


def assert_same_as_built(built, model, params, draws):
    expected = dict(built.named_parameters())
    assert params.keys() == expected.keys()
    different = [name for name, p in params.items() if not torch.equal(p, expected[name])]
    assert not different, different
    buffers = dict(model.named_buffers())
    assert all(torch.equal(buffers[name], b) for name, b in built.named_buffers())
    assert torch.equal(*draws), "the random stream after materializing differs from a normal build's"


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_meta_gpt_materializes_as_built(stage, seed):
    """reset_parameters() of each layer in construction order, then init_fn (the model's own
    apply(_init_weights)) over the tied embedding: bitwise the normal build."""
    built, model, params, draws = materialized(lambda: GPT(GPT_CONFIG), stage, GPT._init_weights, seed)
    assert_same_as_built(built, model, params, draws)
    assert model.lm_head.weight is model.wte.weight
    if stage == 3:  # the parameters keep their shape and hold nothing; stages 1-2 keep them whole
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_meta_hf_llama_materializes_as_built(tied):
    """HuggingFace's nested post_init (LlamaModel initialized before lm_head is built), tied
    embeddings, and the rotary inv_freq buffer the model computes in __init__."""
    pytest.importorskip("transformers")
    from examples import hf_models

    def build():
        config = hf_models.llama_config(models.VOCAB, models.SEQ, layers=2, width=32, heads=4,
                                        kv_heads=2, ffn=64)
        config.tie_word_embeddings = tied
        return hf_models.causal_lm(config)

    built, model, params, draws = materialized(build, 3, seed=0)
    assert_same_as_built(built, model, params, draws)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.model.rotary_emb.original_inv_freq is model.model.rotary_emb.inv_freq


@pytest.mark.parametrize("model_name, options", [
    ("gpt", (("init_fn", GPT._init_weights),)),
    pytest.param("hf_llama", (), marks=pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="needs transformers")),
])
def test_meta_model_trains_as_single_process(model_name, options):
    """Two ranks, stage 3: each materializes only its shards, and training matches the
    single-process model built normally."""
    results = zero_fx_run(2, model_name, "aot_eager", "adamw", 3, options=options, meta=True)
    errors = parity_errors(results, reference_run(model_name))
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


# -- what a meta model cannot do, and says ------------------------------------------------------

class Scale(nn.Module):
    """A parameter set in __init__, no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


class Rotary(nn.Module):
    """A buffer computed in __init__ (on a meta model: no values)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / 10 ** torch.arange(4.0), persistent=False)


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)


class TiedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight


def materialize_meta(cls, init_fn=None):
    with torch.device("meta"):
        model = cls()
    return model, materialize(model, plan_for_module(model, PlanRanks(1), PlanOptions(stage=3)), init_fn=init_fn)


def test_a_module_without_reset_parameters_needs_init_fn():
    with pytest.raises(MaterializeError, match=r"'weight' of Scale has no values.*init_fn"):
        materialize_meta(Scale)
    model, masters = materialize_meta(Scale, init_fn=lambda m: nn.init.ones_(m.weight))
    assert torch.equal(masters["weight"], torch.ones(4))


def test_an_init_that_misses_elements_is_refused():
    def half(module):
        module.weight.data[:2] = 1.0

    with pytest.raises(MaterializeError, match=r"'weight' is only partly initialized.*: 2 of 4"):
        materialize_meta(Scale, init_fn=half)


def test_a_buffer_computed_in_init_is_refused_unless_init_fn_computes_it():
    with pytest.raises(MaterializeError, match=r"buffer 'inv_freq' of Rotary has no values"):
        materialize_meta(Rotary)

    def init(module):
        if isinstance(module, Rotary):
            module.inv_freq = 1.0 / 10 ** torch.arange(4.0)  # registered anew: adopted
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    model, _ = materialize_meta(Rotary, init_fn=init)
    assert torch.equal(model.inv_freq, 1.0 / 10 ** torch.arange(4.0))


def init_children(module):
    """Writes the weights of the module's children (as HuggingFace GPT-2's _init_weights does)."""
    for child in module.children():
        nn.init.zeros_(child.weight)


def test_an_init_that_writes_another_modules_tensor_is_refused():
    with pytest.raises(MaterializeError, match=r"init_fn init_children on the model \(Parent\) "
                                               r"writes 'inner.weight'.*not registered on that"):
        materialize_meta(Parent, init_fn=init_children)


def test_a_tie_made_after_reset_parameters_is_ambiguous_without_init_fn():
    with pytest.raises(MaterializeError, match=r"'a.weight' is tied to 'b.weight'.*order"):
        materialize_meta(TiedTwice)
    model, masters = materialize_meta(TiedTwice, init_fn=lambda m: nn.init.eye_(m.weight)
                                      if isinstance(m, nn.Linear) else None)
    assert torch.equal(masters["a.weight"].view(4, 4), torch.eye(4))


def test_a_refused_meta_model_is_left_unchanged_and_unclaimed():
    """The error comes at the first call, before anything is sharded: the model stays on meta
    and belongs to no step, so a corrected step can take it."""
    with torch.device("meta"):
        model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    with pytest.raises(MaterializeError):
        zero_compile(step, backend="eager")(model, opt, torch.ones(4))
    assert model.weight.is_meta and not hasattr(model.weight, "_zero_fx_sharded_by")
    fixed = zero_compile(step, backend="eager", init_fn=lambda m: nn.init.ones_(m.weight))
    fixed(model, opt, torch.ones(4))
    assert torch.allclose(fixed.full_parameters()["weight"], torch.full((4,), 0.9))


class OpsOnDevice(TorchDispatchMode):
    """Every op whose output lands on ``device``, with the output's number of elements."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.outputs: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                self.outputs.append((str(func), t.numel()))
        return out


def test_stage_3_is_built_on_the_host_and_only_shards_reach_the_device():
    """[Note: built on the host]: the training device receives this rank's shards, never a
    whole parameter. The meta device stands in for the GPU this machine lacks: it holds no
    memory, so each op that outputs a tensor there is one that would have allocated on the
    GPU, and the numbers still come from the CPU, as they would with a GPU."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPT_CONFIG)
    plan = plan_for_module(model, PlanRanks(4, rank=1), PlanOptions(stage=3))
    with OpsOnDevice("meta") as ops:
        masters = materialize(model, plan, init_fn=GPT._init_weights, device=torch.device("meta"))
    largest_shard = max(layout.shard_numel for layout in plan.params)
    assert max(layout.numel for layout in plan.params) > 4 * largest_shard - 4
    # the parameters' placeholders: allocated and released at once ([Note: a sized tensor
    # without storage]); everything else on the device is at most one shard
    written = [(op, n) for op, n in ops.outputs if op != "aten.empty.memory_format"]
    assert written and max(n for _, n in written) <= largest_shard, written
    assert {name: m.numel() for name, m in masters.items()} == {
        layout.name: layout.shard_numel for layout in plan.params}
    assert all(p.device.type == "meta" and p.untyped_storage().nbytes() == 0
               for p in model.parameters())
    # the same values as a build on the CPU: rank 1's shards of the CPU-materialized model
    torch.manual_seed(0)
    with torch.device("meta"):
        on_cpu = GPT(GPT_CONFIG)
    expected = materialize(on_cpu, plan_for_module(on_cpu, PlanRanks(4, rank=1), PlanOptions(stage=3)),
                           init_fn=GPT._init_weights)
    built, _, _, _ = materialized(lambda: GPT(GPT_CONFIG), 3, GPT._init_weights, 0)
    for layout in plan.params:
        start, stop = layout.owned_range(1)
        whole = dict(built.named_parameters())[layout.name].detach().reshape(-1)
        assert torch.equal(expected[layout.name][:stop - start], whole[start:stop]), layout.name
