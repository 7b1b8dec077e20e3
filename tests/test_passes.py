"""Each pass on a tiny hand-built step graph (linear layer + loss + autograd.grad), by op counts."""

import dataclasses
import functools
import math
from operator import getitem

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zero_fx import make_plan
from zero_fx.plan import PlanOptions, PlanRanks
from zero_fx.analysis.memory_timeline import memory_timeline
from zero_fx.passes import (InvariantError, accumulate_embedding_grads, annotate_phases,
                            check_invariants, gather_params, order_weight_grads,
                            recompute_param_views, reduce_grads)
from zero_fx.passes.common.predicates import (GRAD_SLOTS_META, PARAM_META, Phase, gathered_param,
                                              is_all_gather, is_all_reduce, is_reduce_scatter,
                                              is_view, is_wait, kept_through_loss, phase_of, viewed)
from zero_fx.analysis.traffic import traffic_report
from zero_fx.passes.common.collective_code import (all_reduce_bucket, gather_bucket,
                                                   reduce_scatter_bucket)

aten = torch.ops.aten
WORLD = 2


def two_layer_step(w, b, v, x):
    hidden = torch.relu(torch.nn.functional.linear(x, w, b))
    loss = torch.nn.functional.linear(hidden, v).square().mean()
    gw, gb, gv = torch.autograd.grad(loss, [w, b, v])
    return loss.detach(), gw, gb, gv


def step_graph(stage=3):
    w = torch.randn(5, 3, requires_grad=True)  # 15 elements: padded to 16 over 2 ranks
    b = torch.randn(5, requires_grad=True)
    v = torch.randn(2, 5, requires_grad=True)
    gm = make_fx(two_layer_step, tracing_mode="fake")(w, b, v, torch.randn(4, 3))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, "wbv"):
        node.meta[PARAM_META] = name
    gm.meta[GRAD_SLOTS_META] = {1: "w", 2: "b", 3: "v"}
    plan = make_plan([("w", (5, 3), torch.float32, True), ("b", (5,), torch.float32, True),
                      ("v", (2, 5), torch.float32, True)], PlanRanks(WORLD, group_name="test"),
                     PlanOptions(stage=stage))
    return gm, plan


def count(gm, predicate):
    return sum(1 for n in gm.graph.nodes if predicate(n))


def rewritten(*passes, stage=3):
    gm, plan = step_graph(stage)
    for p in passes:
        gm = p(gm, plan)
    return gm, plan


class TestAnnotatePhases:
    def test_backward_starts_at_the_seed(self):
        gm, _ = rewritten(annotate_phases)
        seed = next(n for n in gm.graph.nodes if n.target == aten.ones_like.default)
        assert phase_of(seed) is Phase.BACKWARD
        assert all(phase_of(u) is Phase.BACKWARD for u in seed.users)
        linear = next(n for n in gm.graph.nodes if n.target == aten.addmm.default)
        assert phase_of(linear) is Phase.FORWARD


class TestRecomputeParamViews:
    def test_backward_reads_no_forward_view_of_a_parameter(self):
        gm, _ = rewritten(annotate_phases, recompute_param_views)
        for node in gm.graph.nodes:
            if phase_of(node) is Phase.BACKWARD:
                for arg in node.all_input_nodes:
                    if arg.op == "call_function" and phase_of(arg) is Phase.FORWARD:
                        assert any(a.op != "placeholder" or PARAM_META not in a.meta
                                   for a in arg.all_input_nodes), f"{node} reads {arg}"

    def test_does_nothing_below_stage_3(self):
        gm, plan = step_graph()
        plan = type(plan)(**{**plan.__dict__, "stage": 2})
        before = count(gm, lambda n: True)
        annotate_phases(gm, plan)
        recompute_param_views(gm, plan)
        assert count(gm, lambda n: True) == before


class TestGatherParams:
    def test_stage3_gathers_each_parameter_once_per_phase(self):
        gm, _ = rewritten(annotate_phases, recompute_param_views, gather_params)
        gathers = [n for n in gm.graph.nodes if is_all_gather(n)]
        # w, b, v are read in the forward; v again in the backward (to reach w's gradient)
        assert sorted(phase_of(n).value for n in gathers) == ["backward"] + ["forward"] * 3
        assert count(gm, is_wait) == len(gathers)

    def test_parameters_enter_as_shards(self):
        gm, _ = rewritten(annotate_phases, recompute_param_views, gather_params)
        w, b, v = [n for n in gm.graph.nodes if n.op == "placeholder"][:3]
        assert tuple(w.meta["val"].shape) == (8,)  # ceil(15 / 2)
        assert tuple(b.meta["val"].shape) == (3,)
        assert tuple(v.meta["val"].shape) == (5,)


def _scaled_column_sums(t, *, scale):
    return (t * scale).sum(0)


def _column_sums_plus_ones(t):
    return t.sum(0) + torch.ones(t.shape[1])  # ones of the default dtype


def _doubled(t):
    return t * 2


def _column_sums_of_doubled(t):
    return [_doubled(row) for row in t.unbind(0)][0] + t.sum(0)  # called in a comprehension


class TestSplice:
    """[Note: one trace per distinct splice] in passes/common/splice.py."""

    @pytest.fixture(autouse=True)
    def traces(self, monkeypatch):
        """Every fn traced in the test, with the process's kept traces set aside."""
        import collections

        from zero_fx.passes.common import splice as splice_module

        monkeypatch.setattr(splice_module, "_kept", collections.OrderedDict())
        traces = []
        traced = splice_module.trace_to_aten
        monkeypatch.setattr(splice_module, "trace_to_aten",
                            lambda fn, *mode: traces.append(fn) or traced(fn, *mode))
        return traces

    def _splice(self, code, default_dtype=torch.float32):
        """``code`` spliced on ``v`` (float32) of a newly captured step (a fake mode of its
        own), under ``default_dtype``."""
        from zero_fx.passes.common.splice import splice

        gm, _ = step_graph()
        node = next(n for n in gm.graph.nodes if n.meta.get(PARAM_META) == "v")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default_dtype)
        try:
            return splice(gm.graph, code, [node], before=gm.graph.output_node(),
                          phase=Phase.FORWARD)[0], node
        finally:
            torch.set_default_dtype(previous)

    def _two_gathers(self, traces):
        from zero_fx.passes.common import splice as splice_module

        gm, _ = step_graph()
        w, b, v = [n for n in gm.graph.nodes if n.op == "placeholder"][:3]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        spliced = []
        for node in (v, v, w):  # the same code twice on the same layout, then another layout
            code = functools.partial(_scaled_column_sums, scale=2.0)
            spliced.append(splice_module.splice(gm.graph, code, [node], before=output,
                                                phase=Phase.FORWARD)[0])
        return traces, spliced

    def test_the_same_code_on_the_same_layout_is_traced_once(self, traces):
        traces, (first, again, other) = self._two_gathers(traces)
        assert len(traces) == 2  # v's second splice reused the first trace; w's shape differs
        assert tuple(again.meta["val"].shape) == (5,) == tuple(first.meta["val"].shape)
        assert tuple(other.meta["val"].shape) == (3,)
        assert all(phase_of(n) is Phase.FORWARD for n in (first, again, other))

    def test_a_reused_trace_gives_each_node_a_value_of_its_own(self, traces):
        _, (first, again, _) = self._two_gathers(traces)
        scaled, scaled_again = first.args[0], again.args[0]  # sum(mul(v, 2.0), [0]) twice
        assert scaled is not scaled_again and scaled.args[0] is scaled_again.args[0]
        for a, b in ((first, again), (scaled, scaled_again)):
            assert a.target == b.target
            assert a.meta["val"] is not b.meta["val"]
            assert a.meta["val"].untyped_storage()._cdata != b.meta["val"].untyped_storage()._cdata

    def test_a_trace_serves_later_compilations_and_keeps_no_fake_tensor(self, traces):
        from torch._guards import detect_fake_mode

        from zero_fx.passes.common import splice as splice_module

        code = functools.partial(_scaled_column_sums, scale=2.0)
        first, _ = self._splice(code)
        again, source = self._splice(code)  # another step: another fake mode
        assert len(traces) == 1
        assert detect_fake_mode([again.meta["val"]]) is detect_fake_mode([source.meta["val"]])
        assert detect_fake_mode([again.meta["val"]]) is not detect_fake_mode([first.meta["val"]])
        (kept,) = splice_module._kept.values()
        assert not any(isinstance(leaf, torch.Tensor) for node in kept.nodes
                       for leaf in torch.utils._pytree.tree_leaves(node.meta))

    def test_the_default_dtype_is_part_of_what_decides_a_trace(self, traces):
        single, _ = self._splice(_column_sums_plus_ones)
        double, source = self._splice(_column_sums_plus_ones, default_dtype=torch.float64)
        assert source.meta["val"].dtype == torch.float32 and len(traces) == 2
        assert single.meta["val"].dtype == torch.float32
        assert double.meta["val"].dtype == torch.float64

    def test_a_helper_patched_since_is_traced_anew(self, traces, monkeypatch):
        """As test_parity's missing divide patches collective_code._average out."""
        first, _ = self._splice(_column_sums_of_doubled)
        monkeypatch.setitem(globals(), "_doubled", lambda t: t * 3)
        patched, _ = self._splice(_column_sums_of_doubled)
        assert len(traces) == 2
        doubled = [result.args[0] for result in (first, patched)]  # add(mul(row, k), sum)
        assert [(n.target, n.args[1]) for n in doubled] == [(aten.mul.Tensor, 2),
                                                            (aten.mul.Tensor, 3)]

    def test_the_process_keeps_a_bounded_number_of_traces(self, traces, monkeypatch):
        from zero_fx.passes.common import splice as splice_module

        monkeypatch.setattr(splice_module, "KEPT_TRACES", 1)
        for scale in (2.0, 3.0, 2.0):  # the third was dropped when the second was kept
            self._splice(functools.partial(_scaled_column_sums, scale=scale))
        assert len(traces) == 3 and len(splice_module._kept) == 1


class TestReduceGrads:
    def test_each_gradient_becomes_one_reduce_scatter_of_its_shard(self):
        gm, _ = rewritten(annotate_phases, recompute_param_views, gather_params, reduce_grads)
        assert count(gm, is_reduce_scatter) == 3
        outs = gm.graph.output_node().args[0]
        assert [tuple(o.meta["val"].shape) for o in outs[1:]] == [(8,), (3,), (5,)]
        # fp32: the shard is divided after the sum ([Note: divide before the sum])
        assert all(o.target == aten.div.Tensor and o.args[1] == WORLD for o in outs[1:])
        for o in outs[1:]:  # flatten and pad in one op
            assert viewed(o.args[0].args[0].args[0]).target == aten._chunk_cat.default


class TestBucketCode:
    """[Note: one op per bucket] in collective_code.py: a bucket of four parameters (two padded
    over 2 ranks) is assembled in one op and copied out in one; beyond the collective, each
    parameter costs only the views that give it its shape."""

    SHAPES = [(5, 3), (5,), (2, 5), (7,)]  # 15 and 7 elements are padded over 2 ranks
    PADDED = 2

    @staticmethod
    def ops(fn, inputs):
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not getitem]
        return gm, calls, {n.target: sum(1 for c in calls if c.target == n.target) for n in calls}

    def test_a_gathered_bucket_is_copied_out_in_one_op(self):
        numels = [math.prod(s) for s in self.SHAPES]
        shards = [torch.randn(-(-n // WORLD)) for n in numels]
        code = functools.partial(gather_bucket, numels=numels, shapes=self.SHAPES,
                                 world_size=WORLD, group_name="test")
        gm, calls, ops = self.ops(code, shards)
        assert ops[aten._chunk_cat.default] == 1 and ops[aten.split_with_sizes_copy.default] == 1
        shaping = [c for c in calls if c.target not in (
            aten._chunk_cat.default, aten.split_with_sizes_copy.default) and not is_all_gather(c)
            and not is_wait(c)]
        assert all(is_view(c) for c in shaping), shaping  # no copy per parameter
        # one view each to its shape (none for the 1-D unpadded), a flatten and a slice if padded
        assert len(shaping) <= len(self.SHAPES) + 2 * self.PADDED
        # each parameter is its own tensor: it dies after its own last use, not the bucket's
        fulls = [o.meta["val"] for o in gm.graph.output_node().args[0]]
        assert [tuple(f.shape) for f in fulls] == self.SHAPES
        assert len({f.untyped_storage()._cdata for f in fulls}) == len(fulls)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
    def test_a_reduction_bucket_is_assembled_and_divided_in_one_op_each(self, dtype):
        """[Note: divide before the sum]: in 16 bits the buffer is divided before the
        reduce-scatter sums it; in fp32 the shard after (a division over 1/N the elements)."""
        grads = [torch.randn(s, dtype=dtype) for s in self.SHAPES]
        paddings = [-(-math.prod(s) // WORLD) * WORLD - math.prod(s) for s in self.SHAPES]
        code = functools.partial(reduce_scatter_bucket, paddings=paddings, world_size=WORLD,
                                 group_name="test")
        gm, calls, ops = self.ops(code, grads)
        assert ops[aten._chunk_cat.default] == 1 and ops[aten.div.Tensor] == 1
        assert aten.constant_pad_nd.default not in ops and aten.cat.default not in ops
        (scatter,) = [c for c in calls if is_reduce_scatter(c)]
        (divide,) = [c for c in calls if c.target == aten.div.Tensor]
        assert (viewed(scatter.args[0]) is divide) == (dtype != torch.float32)
        assert divide.args[1] == WORLD
        # only the (5, 3) gradient is flattened first: its 5 rows do not split over 2 ranks
        assert len([c for c in calls if c.target == aten.view.default]) == 2  # it, the buffer
        shards = [o.meta["val"] for o in gm.graph.output_node().args[0]]
        assert [s.numel() for s in shards] == [(n + p) // WORLD for n, p in zip(
            map(math.prod, self.SHAPES), paddings)]

    def test_stage0_divides_the_bucket_before_the_all_reduce(self):
        grads = [torch.randn(s) for s in self.SHAPES]
        code = functools.partial(all_reduce_bucket, world_size=WORLD, group_name="test")
        gm, calls, ops = self.ops(code, grads)
        assert ops[aten._chunk_cat.default] == 1 and ops[aten.div.Tensor] == 1
        (reduce,) = [c for c in calls if is_all_reduce(c)]
        assert reduce.args[0].target == aten.div.Tensor
        assert [tuple(o.meta["val"].shape) for o in gm.graph.output_node().args[0]] == self.SHAPES


    @pytest.mark.parametrize("replicas", [1, 2])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_where_the_backend_averages_no_division_runs(self, dtype, replicas):
        """NCCL (``ShardPlan.collectives_average``): AVG in the collective, a sum that NCCL
        pre-multiplies by 1/N, instead of SUM and a division of ours."""
        grads = [torch.randn(s, dtype=dtype) for s in self.SHAPES]
        paddings = [-(-math.prod(s) // WORLD) * WORLD - math.prod(s) for s in self.SHAPES]
        code = functools.partial(reduce_scatter_bucket, paddings=paddings, world_size=WORLD,
                                 group_name="test", averages=True, replicas=replicas,
                                 replicate_group_name="replicas" if replicas > 1 else "")
        _, calls, ops = self.ops(code, grads)
        assert aten.div.Tensor not in ops and ops[aten._chunk_cat.default] == 1
        collectives = [c for c in calls if is_reduce_scatter(c) or is_all_reduce(c)]
        assert [c.args[1] for c in collectives] == ["avg"] * replicas
        stage0 = functools.partial(all_reduce_bucket, world_size=WORLD, group_name="test",
                                   averages=True)
        _, calls, ops = self.ops(stage0, grads)
        assert aten.div.Tensor not in ops
        assert [c.args[1] for c in calls if is_all_reduce(c)] == ["avg"]

    def test_the_plan_says_whether_the_backend_averages(self):
        gm, plan = step_graph(3)
        averaging = dataclasses.replace(plan, collectives_average=True)
        for p in (annotate_phases, recompute_param_views, gather_params, reduce_grads):
            gm = p(gm, averaging)
        scatters = [n for n in gm.graph.nodes if is_reduce_scatter(n)]
        assert scatters and all(n.args[1] == "avg" for n in scatters)
        assert not any(n.target == aten.div.Tensor for n in gm.graph.nodes)


class TestStages:
    """Where each stage puts its collectives (the same pipeline, read by stage)."""

    ALL = (annotate_phases, recompute_param_views, gather_params, reduce_grads, check_invariants)
    REDUCE_CODE = {aten.view.default, aten._chunk_cat.default, aten.div.Tensor}

    def test_stage0_all_reduces_whole_gradients(self):
        gm, _ = rewritten(*self.ALL, stage=0)
        assert count(gm, is_all_reduce) == 3
        assert count(gm, is_reduce_scatter) == count(gm, is_all_gather) == 0
        outs = gm.graph.output_node().args[0]
        assert [tuple(o.meta["val"].shape) for o in outs[1:]] == [(5, 3), (5,), (2, 5)]

    @pytest.mark.parametrize("stage", [0, 1, 2])
    def test_below_stage3_parameters_enter_whole(self, stage):
        gm, _ = rewritten(*self.ALL, stage=stage)
        assert count(gm, is_all_gather) == 0
        w = next(n for n in gm.graph.nodes if n.op == "placeholder")
        assert tuple(w.meta["val"].shape) == (5, 3)

    def test_stage1_reduces_after_the_whole_backward(self):
        gm, _ = rewritten(*self.ALL, stage=1)
        nodes = list(gm.graph.nodes)
        first = next(i for i, n in enumerate(nodes) if is_reduce_scatter(n))
        after = nodes[first:-1]
        assert count(gm, is_reduce_scatter) == 3
        assert all(is_reduce_scatter(n) or is_wait(n) or n.target in self.REDUCE_CODE
                   for n in after), [n.target for n in after]

    def test_stage2_reduces_during_the_backward(self):
        gm, _ = rewritten(*self.ALL, stage=2)
        nodes = list(gm.graph.nodes)
        first = next(i for i, n in enumerate(nodes) if is_reduce_scatter(n))
        assert any(n.target == aten.mm.default for n in nodes[first:]), \
            "the first reduce-scatter waits for the whole backward"


def tied_embedding_step(wte, ids, targets, padding_idx=None):
    """A token embedding whose weight is also the output head (GPT-2's tying)."""
    hidden = torch.tanh(torch.nn.functional.embedding(ids, wte, padding_idx=padding_idx))
    logits = torch.nn.functional.linear(hidden, wte)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    (grad,) = torch.autograd.grad(loss, [wte])
    return loss.detach(), grad


class TestAccumulateEmbeddingGrads:
    VOCAB, WIDTH, TOKENS = 1000, 64, 16

    def traced(self, padding_idx=None, tokens=TOKENS):
        torch.manual_seed(0)
        inputs = (torch.randn(self.VOCAB, self.WIDTH, requires_grad=True),
                  torch.randint(0, self.VOCAB, (2, tokens // 2)),
                  torch.randint(0, self.VOCAB, (2, tokens // 2)))
        gm = make_fx(lambda *a: tied_embedding_step(*a, padding_idx=padding_idx),
                     tracing_mode="fake")(*inputs)
        next(iter(gm.graph.nodes)).meta[PARAM_META] = "wte"
        gm.meta[GRAD_SLOTS_META] = {1: "wte"}
        return annotate_phases(gm, None), inputs

    def test_the_rows_go_into_the_heads_gradient_one_table_fewer(self):
        gm, inputs = self.traced()
        expected = gm(*inputs)[1]
        peak_before = max(memory_timeline(gm).transient)
        gm = accumulate_embedding_grads(gm)
        assert count(gm, lambda n: n.target == aten.embedding_dense_backward.default) == 0
        assert count(gm, lambda n: n.target == aten.index_put.default) == 1
        torch.testing.assert_close(gm(*inputs)[1], expected, rtol=0, atol=1e-7)  # measured 0
        table, rows = self.VOCAB * self.WIDTH * 4, self.TOKENS * self.WIDTH * 4
        assert peak_before - max(memory_timeline(gm).transient) == table - rows

    @pytest.mark.parametrize("tokens_per_width, late", [(0.25, True), (4, False)])
    def test_the_heads_gradient_is_made_where_the_rows_are_added_if_that_saves(
            self, tokens_per_width, late):
        """[Note: the head's gradient is made where the rows are added]: with fewer tokens
        than the width, the logits' gradient and the hidden states kept to the end are
        smaller than the table, so the head's weight-gradient matmul moves after the rest of
        the backward (here the tanh's); with 4x more tokens than the width it stays."""
        gm, inputs = self.traced(tokens=int(tokens_per_width * self.WIDTH))
        expected = gm(*inputs)[1]
        gm = accumulate_embedding_grads(gm)
        names = [n.target for n in gm.graph.nodes]
        head_grad = next(i for i, n in enumerate(gm.graph.nodes) if n.target == aten.mm.default
                         and n.meta["val"].numel() == self.VOCAB * self.WIDTH)
        assert (head_grad > names.index(aten.tanh_backward.default)) is late
        torch.testing.assert_close(gm(*inputs)[1], expected, rtol=0, atol=1e-7)  # measured 0

    def test_an_embedding_with_a_padding_index_is_left_alone(self):
        gm, _ = self.traced(padding_idx=0)  # its row's gradient is dropped, not summed
        gm = accumulate_embedding_grads(gm)
        assert count(gm, lambda n: n.target == aten.embedding_dense_backward.default) == 1
        assert count(gm, lambda n: n.target == aten.index_put.default) == 0


def wide_head_step(w1, head, x, targets):
    """A small layer, then a wide output head: the head's weight gradient is head-sized."""
    logits = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, w1)), head)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    return (loss.detach(), *torch.autograd.grad(loss, [w1, head]))


class TestOrderWeightGrads:
    VOCAB, WIDTH, TOKENS = 1000, 64, 8

    def traced(self, stage=3, tokens=TOKENS):
        torch.manual_seed(0)
        inputs = (torch.randn(self.WIDTH, self.WIDTH, requires_grad=True),
                  torch.randn(self.VOCAB, self.WIDTH, requires_grad=True),
                  torch.randn(tokens, self.WIDTH), torch.randint(0, self.VOCAB, (tokens,)))
        gm = make_fx(wide_head_step, tracing_mode="fake")(*inputs)
        for node, name in zip(gm.graph.find_nodes(op="placeholder"), ("w1", "head")):
            node.meta[PARAM_META] = name
        gm.meta[GRAD_SLOTS_META] = {1: "w1", 2: "head"}
        plan = make_plan([("w1", (self.WIDTH, self.WIDTH), torch.float32, True),
                          ("head", (self.VOCAB, self.WIDTH), torch.float32, True)],
                         PlanRanks(WORLD, group_name="test"), PlanOptions(stage=stage))
        return recompute_param_views(annotate_phases(gm, plan), plan), plan, inputs

    def backward_matmuls(self, gm):
        """(reads the head, elements of its output) of each backward matmul, in graph order."""
        return [(any(viewed(a).meta.get(PARAM_META) == "head" for a in n.all_input_nodes),
                 n.meta["val"].numel())
                for n in gm.graph.nodes
                if n.target == aten.mm.default and phase_of(n) is Phase.BACKWARD]

    def test_the_heads_input_gradient_runs_first_and_its_gather_is_released_sooner(self):
        gm, plan, inputs = self.traced()
        expected = gm(*inputs)
        head = self.VOCAB * self.WIDTH
        assert self.backward_matmuls(gm)[:2] == [(False, head), (True, self.TOKENS * self.WIDTH)]
        assert self.head_alive_with_its_weight_gradient(self.traced()[0], plan)
        gm = order_weight_grads(gm, plan)
        assert self.backward_matmuls(gm)[:2] == [(True, self.TOKENS * self.WIDTH), (False, head)]
        for value, reference in zip(gm(*inputs), expected):  # the same ops: equal bit for bit
            assert torch.equal(value, reference)
        assert not self.head_alive_with_its_weight_gradient(gm, plan)

    def head_alive_with_its_weight_gradient(self, gm, plan) -> bool:
        """Whether a gathered head and the head-sized weight gradient are ever alive together."""
        gm = gather_params(gm, plan)
        nodes = list(gm.graph.nodes)
        weight_grad = next(n.name for n in nodes if n.target == aten.mm.default
                           and phase_of(n) is Phase.BACKWARD
                           and n.meta["val"].numel() == self.VOCAB * self.WIDTH)
        timeline = memory_timeline(gm)
        gathered_heads = {timeline.buffer_of.get(n.name, n.name) for n in nodes
                          if (gathered_param(n) or ("",))[0] == "head"}
        return any(weight_grad in alive and alive & gathered_heads
                   for alive in ({t.node for t in timeline.live_at(i)} for i in range(len(nodes))))

    def test_a_head_read_first_by_the_backward_is_gathered_once(self):
        """[Note: a weight kept through the loss]: only the loss lies between the head's
        forward read and its input gradient, so its forward gather serves both; with its
        weight gradient first (a matmul between) it is gathered again."""
        def head_gathers(gm):
            return [n for n in gm.graph.nodes if is_all_gather(n)
                    and n.args[0].meta.get(PARAM_META) == "head"]
        gm, plan, _ = self.traced()
        before = gather_params(self.traced()[0], plan)
        assert len(head_gathers(before)) == 2 and kept_through_loss(before) == frozenset()
        gm = gather_params(order_weight_grads(gm, plan), plan)
        assert len(head_gathers(gm)) == 1 and kept_through_loss(gm) == {"head"}
        check_invariants(gm, plan)  # the backward may read this one forward gather

    def test_a_weight_smaller_than_its_input_gradient_stays_after(self):
        """A middle layer (width x width) over more tokens than the width: its input gradient
        (tokens x width) outweighs the weight, so its weight gradient stays first. The head,
        the forward's last matmul, is swapped whatever its size: its gather is then kept
        through the loss ([Note: a weight kept through the loss])."""
        def step(w1, w2, head, x, targets):
            hidden = torch.tanh(torch.nn.functional.linear(x, w1))
            logits = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(hidden, w2)),
                                                head)
            loss = torch.nn.functional.cross_entropy(logits, targets)
            return (loss.detach(), *torch.autograd.grad(loss, [w1, w2, head]))

        tokens, names = 2 * self.VOCAB, ("w1", "w2", "head")
        inputs = (torch.randn(self.WIDTH, self.WIDTH, requires_grad=True),
                  torch.randn(self.WIDTH, self.WIDTH, requires_grad=True),
                  torch.randn(self.VOCAB, self.WIDTH, requires_grad=True),
                  torch.randn(tokens, self.WIDTH), torch.randint(0, self.VOCAB, (tokens,)))
        gm = make_fx(step, tracing_mode="fake")(*inputs)
        for node, name in zip(gm.graph.find_nodes(op="placeholder"), names):
            node.meta[PARAM_META] = name
        gm.meta[GRAD_SLOTS_META] = {1: "w1", 2: "w2", 3: "head"}
        plan = make_plan([(n, (self.VOCAB if n == "head" else self.WIDTH, self.WIDTH),
                           torch.float32, True) for n in names],
                         PlanRanks(WORLD, group_name="test"), PlanOptions(stage=3))
        gm = order_weight_grads(recompute_param_views(annotate_phases(gm, plan), plan), plan)
        reads = [next((name for a in n.all_input_nodes for name in names
                       if viewed(a).meta.get(PARAM_META) == name), None)
                 for n in gm.graph.nodes
                 if n.target == aten.mm.default and phase_of(n) is Phase.BACKWARD]
        # backward matmuls in order (the parameter each reads): the head's input gradient,
        # then its weight gradient; w2's weight gradient, then its input gradient; w1's
        assert reads == ["head", None, None, "w2", None]

    def test_does_nothing_below_stage_3(self):
        gm, plan, _ = self.traced(stage=2)
        before = [n.name for n in gm.graph.nodes]
        assert [n.name for n in order_weight_grads(gm, plan).graph.nodes] == before


class TestCheckInvariants:
    def test_passes_on_the_full_pipeline(self):
        rewritten(annotate_phases, recompute_param_views, gather_params, reduce_grads, check_invariants)

    def test_catches_a_full_parameter_kept_for_the_backward(self):
        gm, plan = rewritten(annotate_phases, gather_params)  # no recompute: backward reads t(v)
        with pytest.raises(InvariantError, match="forward-gathered"):
            check_invariants(gm, plan)


class TestTrafficReport:
    """The report reads kinds, sizes, buckets and positions off the rewritten graph."""

    def test_stage3_hand_built_graph(self):
        gm, plan = rewritten(*TestStages.ALL, stage=3)
        report = traffic_report(gm, plan)
        gathers = [(c.bucket, c.numel, c.phase) for c in report.collectives if c.kind == "all_gather"]
        assert gathers == [(("w",), 16, "forward"), (("b",), 6, "forward"), (("v",), 10, "forward"),
                           (("v",), 10, "backward")]
        assert report.numel_by_kind() == {"all_gather": 42, "reduce_scatter": 32, "all_reduce": 0}
        assert all(c.issued_at < c.waited_at for c in report.collectives)
        assert report.psi == 30 and report.wire_bytes() == (42 + 32) * 4 // 2

    def test_stage1_adds_the_gathers_after_the_step(self):
        gm, plan = rewritten(*TestStages.ALL, stage=1)
        after = [c for c in traffic_report(gm, plan).collectives if c.phase == "after step"]
        assert [(c.bucket, c.numel, c.issued_at) for c in after] == [
            (("w",), 16, None), (("b",), 6, None), (("v",), 10, None)]


def test_a_size_the_data_decides_counts_at_its_upper_bound():
    """Rows chosen by ``nonzero`` (how GraniteMoE and JetMoE route tokens to experts) have an
    unbacked size with no traced value; stage 3's byte counts crashed on it (``int(None)``).
    It counts at its bound: at most every element of the 6x4 input."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from zero_fx.passes.common.predicates import hint, tensor_bytes
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        rows = torch.nonzero(torch.empty(6, 4))
        unbounded = shape_env.create_unbacked_symint()
    assert rows.shape[0].node.hint is None
    assert hint(rows.shape[0]) == 24 and tensor_bytes(rows) == 24 * 2 * 8
    assert hint(unbounded) == 0
