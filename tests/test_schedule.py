"""bucket_collectives and schedule_collectives on a hand-built deep step graph: launch counts,
and where collectives are issued and waited for. Values are checked by the parity tests."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zero_fx import make_plan
from zero_fx.plan import PlanOptions, PlanRanks
from zero_fx.passes import (annotate_phases, bucket_collectives, check_invariants, gather_params,
                            recompute_param_views, reduce_grads, schedule_collectives)
from zero_fx.passes.common.predicates import (GRAD_SLOTS_META, PARAM_META, Phase, carried_params,
                                              is_all_gather, is_collective, is_reduce_scatter,
                                              is_wait, phase_of)
from zero_fx.analysis.traffic import traffic_report

DEPTH = 6
WIDTH = 8  # one weight: 64 fp32 = 256 bytes, 128 bytes per shard over 2 ranks
WEIGHT_BYTES = WIDTH * WIDTH * 4
NAMES = [f"w{i}" for i in range(DEPTH)]


def deep_step(*args):
    *weights, x = args
    h = x
    for w in weights:
        h = torch.relu(h @ w)
    loss = h.square().mean()
    grads = torch.autograd.grad(loss, weights)
    return (loss.detach(), *grads)


def rewritten(stage=3, *, bucket_bytes=0, prefetch=0, memory_budget_bytes=None, resident=(),
              schedule=True):
    weights = [torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in NAMES]
    gm = make_fx(deep_step, tracing_mode="fake")(*weights, torch.randn(4, WIDTH))
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], NAMES):
        node.meta[PARAM_META] = name
    gm.meta[GRAD_SLOTS_META] = {i + 1: name for i, name in enumerate(NAMES)}
    plan = make_plan([(n, (WIDTH, WIDTH), torch.float32, True) for n in NAMES],
                     PlanRanks(2, group_name="test"),
                     PlanOptions(stage=stage, bucket_bytes=bucket_bytes, prefetch=prefetch,
                                 memory_budget_bytes=memory_budget_bytes), resident=resident)
    passes = [annotate_phases, recompute_param_views, gather_params, reduce_grads,
              bucket_collectives] + ([schedule_collectives] if schedule else []) + [check_invariants]
    for p in passes:
        gm = p(gm, plan)
    return gm, plan


def launches(gm, predicate, phase=None):
    return sum(1 for n in gm.graph.nodes
               if predicate(n) and (phase is None or phase_of(n) is phase))


def positions(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


class TestBucketCollectives:
    def test_without_buckets_each_parameter_is_one_launch(self):
        gm, _ = rewritten(bucket_bytes=0)
        assert launches(gm, is_all_gather, Phase.FORWARD) == DEPTH
        assert launches(gm, is_all_gather, Phase.BACKWARD) == DEPTH - 1  # w0's input needs no grad
        assert launches(gm, is_reduce_scatter) == DEPTH

    @pytest.mark.parametrize("per_bucket", [2, 3, DEPTH])
    def test_a_bucket_holds_as_many_parameters_as_fit(self, per_bucket):
        gm, _ = rewritten(bucket_bytes=per_bucket * WEIGHT_BYTES)
        ceil = lambda n: -(-n // per_bucket)  # noqa: E731
        assert launches(gm, is_all_gather, Phase.FORWARD) == ceil(DEPTH)
        assert launches(gm, is_all_gather, Phase.BACKWARD) == ceil(DEPTH - 1)
        assert launches(gm, is_reduce_scatter) == ceil(DEPTH)

    def test_the_report_shows_buckets_and_the_same_traffic(self):
        plain, plan = rewritten(bucket_bytes=0)
        fused, _ = rewritten(bucket_bytes=2 * WEIGHT_BYTES)
        assert traffic_report(fused, plan).numel_by_kind() == traffic_report(plain, plan).numel_by_kind()
        report = traffic_report(fused, plan)
        forward = [c.bucket for c in report.collectives
                   if c.kind == "all_gather" and c.phase == "forward"]
        assert forward == [("w0", "w1"), ("w2", "w3"), ("w4", "w5")]
        reduced = [c.bucket for c in report.collectives if c.kind == "reduce_scatter"]
        assert reduced == [("w5", "w4"), ("w3", "w2"), ("w1", "w0")]  # in the order grads appear
        assert report.launches_by_kind() == {"all_gather": 3 + 3, "reduce_scatter": 3, "all_reduce": 0}

    def test_a_reduction_is_issued_once_its_last_gradient_exists(self):
        gm, _ = rewritten(bucket_bytes=2 * WEIGHT_BYTES, schedule=False)
        order = positions(gm)
        outputs = gm.graph.output_node().args[0]
        grads_by_name = {}
        for node in gm.graph.nodes:
            if is_reduce_scatter(node):
                # the bucket's code reads each gradient; its collective comes after the last
                # one and before any gradient of a later bucket is computed
                for name in carried_params(node):
                    grads_by_name[name] = node
        for later, earlier in [("w3", "w5"), ("w1", "w3")]:
            assert order[grads_by_name[earlier]] < order[grads_by_name[later]]
        assert len(outputs) == DEPTH + 1

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_lower_stages_fuse_their_reductions(self, stage):
        gm, _ = rewritten(stage, bucket_bytes=DEPTH * WEIGHT_BYTES)
        assert launches(gm, is_collective) == 1


class TestScheduleCollectives:
    def test_without_prefetch_each_gather_is_issued_right_before_its_wait(self):
        gm, _ = rewritten(prefetch=0)
        for node in gm.graph.nodes:
            if is_all_gather(node):
                assert node.next is next(iter(node.users))

    def test_prefetch_issues_each_gather_before_the_previous_wait(self):
        gm, _ = rewritten(prefetch=1)
        order = positions(gm)
        for phase in Phase:
            gathers = [n for n in gm.graph.nodes if is_all_gather(n) and phase_of(n) is phase]
            waits = [next(iter(g.users)) for g in gathers]
            for i in range(1, len(gathers)):
                assert order[gathers[i]] < order[waits[i - 1]], f"{phase}: gather {i}"
                assert order[waits[i - 1]] < order[waits[i]]

    def test_waits_stay_right_before_the_first_use(self):
        gm, _ = rewritten(prefetch=2)
        order = positions(gm)
        for wait in (n for n in gm.graph.nodes if is_wait(n) and is_all_gather(n.args[0])):
            # between the wait and the first compute that reads the parameter: only its slice/view
            first_compute = min((u for v in _descendants_in_code(wait) for u in v.users
                                 if not carried_params(u)), key=order.__getitem__)
            between = list(gm.graph.nodes)[order[wait] + 1:order[first_compute]]
            assert all(carried_params(n) or is_all_gather(n) for n in between), between

    def test_reductions_are_waited_late(self):
        gm, _ = rewritten(prefetch=1)
        order = positions(gm)
        reductions = [n for n in gm.graph.nodes if is_reduce_scatter(n)]
        for i in range(len(reductions) - 1):
            wait = next(iter(reductions[i].users))
            assert order[reductions[i + 1]] > order[wait] > order[reductions[i]]
            compute_between = [n for n in list(gm.graph.nodes)[order[reductions[i]]:order[wait]]
                               if not carried_params(n) and n.op == "call_function"]
            assert compute_between, f"reduction {i} is waited for before any compute overlaps it"

    def test_a_memory_budget_limits_prefetch(self):
        budget = 2 * WEIGHT_BYTES  # the gather in use plus one more
        tight, _ = rewritten(prefetch=3, memory_budget_bytes=WEIGHT_BYTES)
        for node in tight.graph.nodes:
            if is_all_gather(node):
                assert node.next is next(iter(node.users)), "a budget of one parameter allows no prefetch"
        roomy, _ = rewritten(prefetch=3, memory_budget_bytes=budget)
        order = positions(roomy)
        gathers = [n for n in roomy.graph.nodes if is_all_gather(n) and phase_of(n) is Phase.FORWARD]
        waits = [next(iter(g.users)) for g in gathers]
        for i in range(1, len(gathers)):
            # one ahead, never more: issued after the wait two back
            assert order[gathers[i]] < order[waits[i - 1]]
            if i >= 2:
                assert order[gathers[i]] > order[waits[i - 2]]

    def test_prefetch_moves_gathers_earlier_and_keeps_each_kinds_order(self):
        """The collective sequence, written out: forward gathers in order of use, backward
        gathers in reverse (w0's gradient needs no w0: it is not re-gathered), each bucket's
        reduce-scatter after its last gradient. Prefetch issues a gather one bucket early,
        ahead of a reduce-scatter; among gathers, and among reduce-scatters, the order is
        the unscheduled one (every rank runs this same sequence)."""
        def sequence(gm):
            return [("AG" if is_all_gather(n) else "RS", carried_params(n), phase_of(n).value)
                    for n in gm.graph.nodes if is_collective(n)]

        scheduled, _ = rewritten(prefetch=1, bucket_bytes=2 * WEIGHT_BYTES)
        plain, _ = rewritten(prefetch=0, bucket_bytes=2 * WEIGHT_BYTES)
        forward = [("AG", ("w0", "w1"), "forward"), ("AG", ("w2", "w3"), "forward"),
                   ("AG", ("w4", "w5"), "forward")]
        assert sequence(plain) == forward + [
            ("AG", ("w5", "w4"), "backward"), ("RS", ("w5", "w4"), "backward"),
            ("AG", ("w3", "w2"), "backward"), ("RS", ("w3", "w2"), "backward"),
            ("AG", ("w1",), "backward"), ("RS", ("w1", "w0"), "backward")]
        assert sequence(scheduled) == forward + [
            ("AG", ("w5", "w4"), "backward"), ("AG", ("w3", "w2"), "backward"),
            ("RS", ("w5", "w4"), "backward"), ("AG", ("w1",), "backward"),
            ("RS", ("w3", "w2"), "backward"), ("RS", ("w1", "w0"), "backward")]


class TestResidency:
    def test_a_resident_parameter_is_gathered_once_per_step(self):
        gm, plan = rewritten(resident=("w3",))
        gathered = [carried_params(n) for n in gm.graph.nodes if is_all_gather(n)]
        assert gathered.count(("w3",)) == 1
        assert gathered.count(("w2",)) == 2
        report = traffic_report(gm, plan)
        plain, _ = rewritten()
        saved = traffic_report(plain, plan).numel_by_kind()["all_gather"] - \
            report.numel_by_kind()["all_gather"]
        assert saved == WIDTH * WIDTH

    def test_residents_share_gather_buckets_only_with_each_other(self):
        # One bucket would hold every weight; a resident in it would keep the whole
        # gathered buffer alive until the backward (Inductor reads its slice in place).
        gm, plan = rewritten(resident=("w1", "w3"), bucket_bytes=DEPTH * WEIGHT_BYTES)
        forward = [set(carried_params(n)) for n in gm.graph.nodes
                   if is_all_gather(n) and phase_of(n) is Phase.FORWARD]
        assert sorted(map(sorted, forward)) == sorted(
            [["w1", "w3"], sorted(set(NAMES) - {"w1", "w3"})])

    def test_residency_is_a_stage3_notion(self):
        plan = make_plan([("w", (4,), torch.float32, True)], PlanRanks(2), PlanOptions(stage=2),
                         resident=("w",))
        assert plan.resident == frozenset()

    def test_an_unknown_resident_name_is_an_error(self):
        with pytest.raises(ValueError, match="not in the model"):
            make_plan([("w", (4,), torch.float32, True)], PlanRanks(2), resident=("v",))


def _descendants_in_code(wait):
    out, stack = [], [wait]
    while stack:
        node = stack.pop()
        if node not in out and carried_params(node):
            out.append(node)
            stack.extend(node.users)
    return out
