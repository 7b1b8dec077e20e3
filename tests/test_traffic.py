"""Traffic: what the collectives move per step, counted as they run, equals the report and the table.

The count comes from ``CollectiveCounter``, a dispatch mode around the
compiled graph and the optimizer step, on the second step of the test GPT (aot_eager), on
gloo ranks or on a fake group in the test process; the Inductor run counts the last of the
parity runs' 5 steps. The table's multiples of Ψ are in zero_fx/planner/table.py;
every all-gather and reduce-scatter works on padded parameters (Ψ + padding),
an all-reduce on the parameters as they are.
"""

from collections import Counter

import pytest

from support import models
from support.ranks import fake_world, run_ranks
from support.training import SMALL_BUCKETS, UNSCHEDULED, counted_traffic_rank, zero_fx_run
from zero_fx import plan_for_module
from zero_fx.plan import PlanRanks
from zero_fx.config import ZeroConfig
from zero_fx.planner.table import TRAFFIC_IN_PSI
from zero_fx.analysis.traffic import KINDS

# In stage 3 the backward re-gathers only the parameters its gradient formulas
# read; the GPT's position embedding is an embedding: its gradient is a
# scatter of the incoming gradient, which never reads the table.
NOT_READ_BY_BACKWARD = {"wpe.weight"}
# Its head, tied to the token embedding, is the last weight the forward reads and the
# first the backward reads: gathered once ([Note: a weight kept through the loss]).
KEPT_THROUGH_LOSS = {"wte.weight"}


def expected_numel(stage: int, world_size: int, options: tuple = ()) -> dict:
    """The table's multiples of Ψ (padded); in stage 3 minus the backward gathers of
    parameters the backward never reads, that stay resident or are kept through the loss."""
    config = ZeroConfig(stage=stage, **dict(options))
    plan = plan_for_module(models.build("gpt"), PlanRanks(world_size), config.plan_options())
    padded = plan.total_numel + plan.padding_numel
    expected = {kind: 0 for kind in KINDS}
    for kind, multiple in TRAFFIC_IN_PSI[stage].items():
        expected[kind] = multiple * (plan.total_numel if kind == "all_reduce" else padded)
    if stage == 3:
        not_regathered = NOT_READ_BY_BACKWARD | KEPT_THROUGH_LOSS | plan.resident
        expected["all_gather"] -= sum(plan.layout(n).padded_numel for n in not_regathered)
    return expected


def counted_traffic(world_size: int, group: str, stage: int, options: tuple = ()) -> list:
    """Each rank's ``training.counted_traffic_rank``: on gloo ranks, or as rank 0 of a fake
    group in this process (the collectives issued and their shapes are real there, which is
    all these tests count)."""
    if group == "gloo":
        return run_ranks(world_size, counted_traffic_rank, stage, options)
    with fake_world(world_size):
        return [counted_traffic_rank(0, world_size, stage, options)]


@pytest.mark.parametrize("options", [(), SMALL_BUCKETS], ids=["defaults", "small-buckets"])
@pytest.mark.parametrize("world_size, group", [(2, "gloo"), (4, "fake")])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_counted_traffic_equals_report_and_table(stage, world_size, group, options):
    for rank, result in enumerate(counted_traffic(world_size, group, stage, options)):
        report, counted = result["traffic"], result["counted"]
        assert counted["numel"] == report.numel_by_kind(), f"rank {rank}: counted != report"
        launches = Counter({kind: 0 for kind in KINDS}) + Counter(c.kind for c in report.collectives)
        assert counted["launches"] == {k: launches[k] for k in KINDS}, f"rank {rank}"
        assert report.numel_by_kind() == expected_numel(stage, world_size, options), f"rank {rank}"


@pytest.mark.inductor
def test_counted_traffic_equals_report_under_inductor():
    """Inductor calls collectives as fallback kernels, so the counter sees them too."""
    for result in zero_fx_run(2, "gpt", "inductor"):
        assert result["counted"]["numel"] == result["traffic"].numel_by_kind()
        assert result["traffic"].numel_by_kind() == expected_numel(3, 2)


def test_stage3_backward_regathers_all_but_what_it_never_reads_or_keeps():
    report = counted_traffic(2, "fake", 3, UNSCHEDULED)[0]["traffic"]
    names = {n for n, _ in models.build("gpt").named_parameters()}
    backward = {c.bucket[0] for c in report.collectives
                if c.kind == "all_gather" and c.phase == "backward"}
    assert backward == names - NOT_READ_BY_BACKWARD - KEPT_THROUGH_LOSS


def test_the_report_shows_psi_multiples_and_positions():
    report = counted_traffic(2, "fake", 1)[0]["traffic"]
    text = str(report)
    assert "stage 1, 2 rank(s)" in text and "reduce_scatter" in text and "after step" in text
    assert report.psi_by_kind()["all_reduce"] == 0
    assert 1.0 <= report.psi_by_kind()["reduce_scatter"] < 1.01  # padding only
    reduces = [c for c in report.collectives if c.kind == "reduce_scatter"]
    assert all(c.issued_at < c.waited_at for c in reduces)


def test_one_rank_moves_nothing():
    for stage in (0, 3):
        report = counted_traffic_rank(0, 1, stage)["traffic"]
        assert report.collectives == () and report.wire_bytes() == 0


def test_the_report_gives_the_routed_experts_share(fake_world_of_two):
    """A Mixtral at stage 3 (experts above the residency threshold): the experts' parameters
    are gathered twice and reduce-scattered once, like every other, and the report says
    how much of each kind they are."""
    pytest.importorskip("transformers")
    step, model = models.mixtral_after_one_step()
    report = step.traffic()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert report.expert_numel == {"all_gather": 2 * experts, "reduce_scatter": experts,
                                   "all_reduce": 0}
    assert report.expert_numel["all_gather"] < report.numel_by_kind()["all_gather"]
    assert f"of which routed experts' parameters: all_gather {2 * experts:,} elements" in str(report)
