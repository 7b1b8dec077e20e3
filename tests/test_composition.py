"""Composition: the user's passes placed among ours by name, ours disabled by name, and
our passes run on a graph that did not come from zero_compile."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from support import models
from zero_fx import after, before, plan_for_module, zero_compile
from zero_fx.plan import PlanOptions, PlanRanks
from zero_fx.passes import build_pipeline, mark_step_graph, pass_names, run_pipeline
from zero_fx.passes.common.predicates import GATHERED_META, PHASE_META, is_all_gather
from zero_fx.analysis.traffic import traffic_report

aten = torch.ops.aten


def _compiled(**options):
    return zero_compile(models.training_step("mlp"), stage=3, backend="aot_eager", **options)


def _run(step):
    model = models.build("mlp")
    opt = models.make_optimizer(model)
    return step(model, opt, *models.global_batch("mlp", 0))


def test_user_passes_run_where_they_are_placed():
    seen = []

    def first(gm):
        seen.append(("first", any(PHASE_META in n.meta for n in gm.graph.nodes)))

    def after_gather(gm):
        seen.append(("after_gather", any(GATHERED_META in n.meta for n in gm.graph.nodes)))

    def last(gm):
        seen.append(("last", True))
        return gm

    step = _compiled(passes=[last, after("gather_params", after_gather), before("annotate_phases", first)])
    _run(step)
    # before annotate_phases nothing is tagged; after gather_params full parameters are
    assert seen == [("first", False), ("after_gather", True), ("last", True)]
    assert [p.name for p in step._compiler.pipeline] == pass_names(extra=step.config.passes) == [
        "first", "annotate_phases", "scale_loss", "recompute_activations", "recompute_param_views",
        "order_weight_grads", "gather_params", "after_gather", "accumulate_embedding_grads", "reduce_grads",
        "bucket_collectives", "quantize_collectives", "schedule_collectives", "update_in_graph", "last",
        "check_invariants"]


def test_a_user_pass_changes_what_runs():
    def double_the_loss(gm):
        output = gm.graph.output_node()
        loss = output.args[0][0]
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(aten.mul.Tensor, (loss, 2.0))
        doubled.meta.update(loss.meta)
        output.update_arg(0, (doubled, *output.args[0][1:]))
        gm.recompile()
        return gm

    loss = _run(_compiled(passes=[double_the_loss]))
    model = models.build("mlp")
    expected = models.loss_fn("mlp", model, *models.global_batch("mlp", 0))
    torch.testing.assert_close(loss, 2 * expected.detach())


def test_disabled_passes_do_not_run():
    step = _compiled(disable_passes=["schedule_collectives", "bucket_collectives"])
    _run(step)
    names = [p.name for p in step._compiler.pipeline]
    assert "schedule_collectives" not in names and "bucket_collectives" not in names


@pytest.mark.parametrize("passes, error, message", [
    ([after("no_such_pass", lambda gm: gm)], ValueError, "unknown pass 'no_such_pass'"),
    ([3], TypeError, "must be a function gm -> gm"),
])
def test_bad_placements_fail_at_decoration(passes, error, message):
    with pytest.raises(error, match=message):
        _compiled(passes=passes)


def test_placing_next_to_a_disabled_pass_is_an_error():
    with pytest.raises(ValueError, match="is disabled"):
        _compiled(disable_passes=["schedule_collectives"],
                  passes=[after("schedule_collectives", lambda gm: gm)])


def test_a_user_pass_must_return_the_graph():
    with pytest.raises(Exception, match="returned int"):
        _run(_compiled(passes=[lambda gm: 1]))


# -- our passes on a graph from elsewhere --------------------------------------------------

def _foreign_step_graph():
    """A training-step graph made without zero_fx: make_fx of forward + autograd.grad."""
    model = models.build("mlp")
    params = dict(model.named_parameters())
    x, y = models.global_batch("mlp", 0)

    def step(params, x, y):
        out = torch.func.functional_call(model, params, (x,))
        loss = torch.nn.functional.mse_loss(out, y)
        return (loss.detach(), *torch.autograd.grad(loss, list(params.values())))

    gm = make_fx(step)(params, x, y)
    mark_step_graph(gm, [*params, None, None], {i + 1: name for i, name in enumerate(params)})
    return gm, model, params, (x, y)


def test_our_passes_rewrite_a_foreign_graph_for_four_ranks():
    gm, model, params, _ = _foreign_step_graph()
    plan = plan_for_module(model, PlanRanks(4, group_name="planned"),
                           PlanOptions(stage=3, resident_max_numel=0))
    gm = run_pipeline(gm, build_pipeline(plan))
    report = traffic_report(gm, plan)
    psi = report.psi_by_kind()
    assert psi["reduce_scatter"] == pytest.approx(1.0, abs=0.1)
    assert 1.0 < psi["all_gather"] <= 2.1
    assert sum(is_all_gather(n) for n in gm.graph.nodes) == report.launches_by_kind()["all_gather"]


def test_our_passes_on_a_foreign_graph_keep_its_gradients():
    gm, model, params, (x, y) = _foreign_step_graph()
    plan = plan_for_module(model, PlanRanks(1, group_name="planned"), PlanOptions(stage=3))
    rewritten = run_pipeline(gm, build_pipeline(plan))
    shards = {name: p.detach().reshape(-1) for name, p in params.items()}  # one rank: all of it
    loss, *grads = rewritten(shards, x, y)
    reference = torch.autograd.grad(
        torch.nn.functional.mse_loss(model(x), y), list(model.parameters()))
    for got, expected in zip(grads, reference):
        torch.testing.assert_close(got.reshape(expected.shape), expected)


def test_mark_step_graph_checks_its_arguments():
    gm, *_ = _foreign_step_graph()
    with pytest.raises(ValueError, match="placeholders"):
        mark_step_graph(gm, ["w"], {})
    with pytest.raises(ValueError, match="outputs"):
        mark_step_graph(gm, [None] * 8, {99: "w"})
