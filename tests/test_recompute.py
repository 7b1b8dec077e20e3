"""Activation recompute (passes/recompute_activations.py): what it claims to drop is dropped
(measured), training is unchanged (every stage, dropout, bf16, world 2 and 4), stage 3
gathers no more, and the model's own torch.utils.checkpoint trains with dropout."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from support import models
from support.ranks import run_ranks
from support.training import parity_errors, reference_run, zero_fx_run
from zero_fx import MixedPrecision, ZeroConfig, after, zero_compile
from zero_fx.inspection.report_sections import describe_recompute
from zero_fx.analysis.live_memory import LiveTensorBytes
from zero_fx.passes.recompute_activations import RECOMPUTE_META, RECOMPUTED_META

MODES = ("blocks", "auto", models.save_matmuls)
TOLERANCE = 1e-5


class LiveAtBackwardStart(LiveTensorBytes):
    """Live tensor bytes when the backward starts (autograd's ``ones_like`` seed)."""

    at_seed = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.ones_like.default and self.at_seed is None:
            self.at_seed = self.live
        return super().__torch_dispatch__(func, types, args, kwargs)


def live_at_backward_start(model_name, recompute, passes=()):
    """(bytes alive when the backward starts, the pass's summary), one rank, the rewritten
    graph run as it is (backend "eager", whole), second call."""
    model = models.build(model_name)
    opt = models.make_optimizer(model, "adamw")
    step = zero_compile(models.training_step(model_name), stage=0, backend="eager",
                        regional=False, recompute=recompute, passes=passes)
    x, y = models.global_batch(model_name, 0)
    step(model, opt, x, y)
    counter = LiveAtBackwardStart()
    with step.observing(counter):
        step(model, opt, x, y)
    return counter.at_seed, step.graphs[-1].meta.get(RECOMPUTE_META)


@pytest.mark.parametrize("model_name, mode", [("gpt_dropout", "blocks"), ("gpt_dropout", "auto"),
                                              ("gpt_dropout", models.save_matmuls),
                                              ("hf_llama", "blocks")],
                         ids=["blocks", "auto", "policy", "hf_llama-blocks"])
def test_what_it_claims_to_drop_is_not_alive_when_the_backward_starts(model_name, mode):
    if model_name.startswith("hf"):
        pytest.importorskip("transformers")
    kept_all, _ = live_at_backward_start(model_name, None)
    kept, summary = live_at_backward_start(model_name, mode)
    assert summary.dropped_bytes > 0.3 * summary.kept_bytes_before
    assert kept_all - kept == summary.dropped_bytes


def _keep_one_original(gm):
    """A broken recompute: one copy's readers go back to the forward original."""
    copy = next(n for n in gm.graph.nodes if n.meta.get(RECOMPUTED_META) and n.users
                and "mm" in str(n.target))
    original = next(n for n in gm.graph.nodes if n.name == copy.meta[RECOMPUTED_META])
    copy.replace_all_uses_with(original)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def test_a_value_kept_against_the_claim_is_caught():
    kept_all, _ = live_at_backward_start("gpt", None)
    kept, summary = live_at_backward_start("gpt", "blocks",
                                           passes=[after("recompute_activations", _keep_one_original)])
    assert kept_all - kept < summary.dropped_bytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_blocks_train_as_single_process(stage):
    results = zero_fx_run(2, "gpt", models.BACKEND, stage=stage, options=(("recompute", "blocks"),))
    errors = parity_errors(results, reference_run("gpt"))
    assert max(errors.values()) < TOLERANCE, max(errors, key=errors.get)


@pytest.mark.parametrize("world_size, stage, mode", [
    (4, 3, "auto"), (2, 0, "auto"), (2, 1, "auto"), (4, 3, "blocks"), (2, 2, models.save_matmuls),
    (2, 3, models.save_matmuls)])
def test_other_modes_and_worlds_train_as_single_process(world_size, stage, mode):
    results = zero_fx_run(world_size, "gpt", models.BACKEND, stage=stage, options=(("recompute", mode),))
    errors = parity_errors(results, reference_run("gpt"))
    assert max(errors.values()) < TOLERANCE, max(errors, key=errors.get)


@pytest.mark.inductor
def test_blocks_under_inductor_train_as_single_process():
    results = zero_fx_run(2, "gpt", "inductor", stage=3, options=(("recompute", "blocks"),))
    errors = parity_errors(results, reference_run("gpt"))
    assert max(errors.values()) < TOLERANCE, max(errors, key=errors.get)


def test_stage3_recompute_gathers_no_more():
    """A recomputed matmul reads the backward's own gather: the same collectives move the
    same bytes as without recompute."""
    plain = zero_fx_run(2, "gpt", models.BACKEND, stage=3)
    recomputed = zero_fx_run(2, "gpt", models.BACKEND, stage=3, options=(("recompute", "blocks"),))
    assert recomputed[0]["counted"] == plain[0]["counted"]


def test_dropout_is_replayed_with_the_forwards_mask():
    """One rank: the same draws as eager single-process training (same seed); two ranks:
    each rank's masks are the same with and without recompute, so training is identical."""
    reference = reference_run("gpt_dropout")
    for mode in MODES:
        one = zero_fx_run(1, "gpt_dropout", models.BACKEND, stage=3, options=(("recompute", mode),))
        assert max(parity_errors(one, reference).values()) < TOLERANCE
    plain = zero_fx_run(2, "gpt_dropout", models.BACKEND, stage=3)
    blocks = zero_fx_run(2, "gpt_dropout", models.BACKEND, stage=3, options=(("recompute", "blocks"),))
    for rank in range(2):
        assert blocks[rank]["losses"] == plain[rank]["losses"]
        assert all(torch.equal(blocks[rank]["params"][n], p)
                   for n, p in plain[rank]["params"].items())
    assert plain[0]["losses"] != zero_fx_run(2, "gpt", models.BACKEND, stage=3)[0]["losses"]


def test_bf16_recompute_equals_bf16_without():
    bf16 = (("mixed_precision", MixedPrecision(param_dtype=torch.bfloat16)),)
    plain = zero_fx_run(2, "gpt", models.BACKEND, stage=3, options=bf16)
    blocks = zero_fx_run(2, "gpt", models.BACKEND, stage=3, options=bf16 + (("recompute", "blocks"),))
    assert blocks[0]["losses"] == plain[0]["losses"]
    assert all(torch.equal(blocks[0]["params"][n], p) for n, p in plain[0]["params"].items())


def _dropout_step(checkpointed: bool):
    def step(model, opt, x, y):
        def block(x):
            return F.dropout(model(x), p=0.1, training=True)
        out = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _checkpointed_and_plain(rank, world_size):
    out = []
    for checkpointed in (False, True):
        model = models.build("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = zero_compile(_dropout_step(checkpointed), stage=3, backend=models.BACKEND)
        losses = []
        for i in range(3):
            x, y = models.global_batch("mlp", i)
            losses.append(step(model, opt, x[rank::world_size], y[rank::world_size]).item())
        summary = step.graphs[-1].meta.get(RECOMPUTE_META)
        out.append((losses, step.full_parameters(), summary and summary.mode))
    return out


def test_torch_utils_checkpoint_with_dropout_trains_as_without():
    """The model's own checkpoint is inlined and recomputed by our pass, dropout mask kept
    ([Note: torch.utils.checkpoint in a captured step])."""
    (plain_losses, plain_params, none), (losses, params, mode) = run_ranks(2, _checkpointed_and_plain)[0]
    assert (none, mode) == (None, "blocks")
    assert losses == plain_losses
    assert all(torch.equal(params[n], plain_params[n]) for n in params)


def _hf_gradient_checkpointing(rank, world_size):
    from examples import hf_models

    out = []
    for checkpointing, dropout in ((False, 0.1), (True, 0.1), (False, 0.0)):
        torch.manual_seed(0)
        config = hf_models.gpt2_config(models.VOCAB, models.SEQ, layers=2, width=32, heads=2)
        config.resid_pdrop = config.embd_pdrop = dropout
        config.use_cache = False
        model = hf_models.causal_lm(config)
        if checkpointing:
            model.gradient_checkpointing_enable()
        opt = models.make_optimizer(model, "adamw")
        step = zero_compile(models.training_step("hf_gpt2"), stage=3, backend=models.BACKEND)
        losses = [step(model, opt, *models.global_batch("hf_gpt2", i)).item() for i in range(3)]
        summary = step.graphs[-1].meta.get(RECOMPUTE_META)
        out.append((losses, summary and summary.mode))
    return out


def test_hf_gradient_checkpointing_with_dropout_trains_as_without():
    pytest.importorskip("transformers")
    plain, checkpointed, no_dropout = run_ranks(1, _hf_gradient_checkpointing)[0]
    assert (plain[1], checkpointed[1]) == (None, "blocks")
    assert checkpointed[0] == plain[0]
    assert no_dropout[0] != plain[0]  # the dropout ran


@pytest.mark.parametrize("options, message", [
    ({"recompute": "all"}, "recompute must be None, 'blocks', 'auto'"),
    ({"recompute": "blocks", "activation_memory_budget": 0.5}, "goes with recompute='auto'"),
    ({"activation_memory_budget": -1}, "activation_memory_budget must be"),
])
def test_bad_recompute_options_say_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def test_blocks_on_a_model_without_blocks_says_what_to_use():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    with pytest.raises(ValueError, match="found no repeated blocks"):
        zero_compile(step, stage=0, backend="eager", recompute="blocks")(model, opt, torch.ones(2, 4))


def test_explain_and_the_graph_view_show_what_is_recomputed(tmp_path):
    model = models.build("gpt")
    opt = models.make_optimizer(model, "adamw")
    step = zero_compile(models.training_step("gpt"), stage=3, backend="eager", recompute="blocks",
                        dump_dir=str(tmp_path))
    step(model, opt, *models.global_batch("gpt", 0))
    summary = step.graphs[-1].meta[RECOMPUTE_META]
    assert describe_recompute(summary) in str(step.explain())
    assert summary.recomputed_ops > 0 and summary.kept_bytes < summary.kept_bytes_before / 2
    final = sorted(tmp_path.rglob("*check_invariants.html"))[-1].read_text()
    assert final.count("class='recomputed backward") == sum(
        1 for n in step.graphs[-1].graph.nodes if n.meta.get(RECOMPUTED_META))
