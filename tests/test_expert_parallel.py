"""Expert parallelism's set-up and errors ([Note: expert parallelism] in
zero_fx/plan/expert_parallel.py), in one process: the options it refuses, the plan it makes,
and a step on a fake world of 4. Its parity with HF eager at world 4 is tests/test_moe.py's
(``test_expert_parallel_trains_as_single_process``)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from support import models
from zero_fx import ZeroConfig
from zero_fx.capture.experts.moe_blocks import RoutedExperts
from zero_fx.passes.common.predicates import zero_fx_op_name
from zero_fx.plan.expert_parallel import ExpertParallel, expert_slices
from zero_fx.plan import PlanOptions, PlanRanks, make_plan
from zero_fx.runtime.distributed.expert_groups import split_experts
from zero_fx.runtime.distributed.process_group import World
from support.ranks import run_ranks

pytest.importorskip("transformers")

EXPERTS = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("options, words", [
    (dict(stage=0, expert_parallel=2), "needs stage 1, 2 or 3"),
    (dict(stage=3, expert_parallel=0), "int >= 1"),
    (dict(stage=3, expert_parallel=True), "int >= 1"),
])
def test_options_it_refuses(options, words):
    with pytest.raises(ValueError, match=words):
        ZeroConfig(**options)


def block(experts: int) -> RoutedExperts:
    return RoutedExperts(name="model.layers.0.mlp", experts=EXPERTS, num_experts=experts,
                         top_k=2, routing="softmax, top-2", expert_parameters=0,
                         shared_expert=None)


@pytest.mark.parametrize("blocks, world, words", [
    ([], 4, "found no mixture-of-experts block"),
    ([block(6)], 4, "has 6 experts: choose a degree that divides 6"),
    ([block(8)], 6, "must divide the 6 ranks"),
])
def test_worlds_and_models_it_refuses(blocks, world, words):
    """Refused before any process group is made: the model's blocks and the world size
    are read first."""
    with pytest.raises(ValueError, match=words):
        split_experts(torch.nn.Linear(2, 2), blocks, World(size=world, rank=0, group_name="w"),
                      degree=4)


def test_the_plan_shards_experts_over_the_ranks_that_hold_them():
    """World 4, EP 2, rank 1 (place 1, data rank 0): experts 2-3 of 4 are its own,
    sharded over 2 ranks; experts 0-1 are not held; the rest over all 4 ranks."""
    names = [f"{EXPERTS}.{i}.w" for i in range(4)] + ["model.norm.weight"]
    parallel = ExpertParallel(degree=2, rank=1, group_name="ep", data_size=2, data_rank=0,
                              data_group_name="edp",
                              slices=expert_slices({EXPERTS: 4}, names, 2))
    assert parallel.slices == {names[0]: 0, names[1]: 0, names[2]: 1, names[3]: 1}
    plan = make_plan([(n, (6, 5), torch.float32, True) for n in names],
                     PlanRanks(4, rank=1, expert_parallel=parallel),
                     PlanOptions(stage=3, bucket_bytes="blocks"))
    assert [plan.holds(n) for n in names] == [False, False, True, True, True]
    assert plan.collective_group(names[2]) == (2, "edp")
    assert plan.collective_group("model.norm.weight") == (4, plan.group_name)
    assert plan.layout(names[2]).shard_numel == 15 and plan.layout(names[4]).shard_numel == 8
    assert plan.shard_numel == 15 + 15 + 8  # what this rank holds
    assert plan.shard_rank(names[3]) == 0 and plan.shard_rank(names[4]) == 1
    assert plan.buckets(names) == [names[:4], names[4:]]  # experts apart from the rest


def test_a_step_on_a_fake_world_of_four(fake_world_of_four):
    """Shapes and memory as a real run's (the fake group returns no values: each rank's
    counts stand for every peer's). Rank 0 holds experts 0-1 of 4, gathers them over its
    2-rank expert-data-parallel group, and exchanges T*k rows per block 4 times a step
    (its checkpoints: tests/test_moe.py, on real ranks)."""
    step, model = models.mixtral_after_one_step(layers=1, experts=4, expert_parallel=2)
    if step.moe_blocks[0].stacked:
        pytest.skip("transformers 5 holds Mixtral's experts as 3-D parameters: "
                    "test_experts_held_as_3d_parameters_split_by_rows is this test for them")
    held = {n: s.numel() for n, s in step.state.shards.items() if ".experts." in n}
    assert {n.split(".experts.")[1].split(".")[0] for n, numel in held.items() if numel} == {"0", "1"}
    report = step.traffic()
    tokens = models.global_batch("hf_llama", 0)[0].numel()  # the whole batch on this "rank"
    rows = [c for c in report.collectives if c.kind == "all_to_all" and c.dtype.is_floating_point]
    assert [c.numel for c in rows] == [tokens * 2 * 64] * 4  # top-2, width 64
    expert_gathers = [c for c in report.collectives if c.group == "expert-data-parallel group"]
    assert expert_gathers and all(".experts.0." in c.bucket[0] for c in expert_gathers)
    assert "this rank runs experts 0-1 of each block" in str(step.explain())
    # whole values of every expert, this rank's and the others' (shapes: the group is fake)
    expected = {n: p.shape for n, p in model.named_parameters()}
    for offload in (True, False):
        whole = step.full_state_dict(cpu_offload=offload)
        assert {n: whole[n].shape for n in expected} == expected
    with step.gathered_parameters():
        assert all(p.untyped_storage().nbytes() for p in model.parameters())


def test_the_plan_keeps_a_place_s_rows_of_experts_held_as_3d_parameters():
    """[Note: experts held as 3-D parameters, split by rows]: world 4, EP 2, rank 1. The
    parameter is this place's rows (its shape in the plan is (E/P, ...)), held on every rank,
    sharded over the expert-data-parallel group; its whole shape is every place's rows."""
    rows = f"{EXPERTS}.gate_up_proj"
    parallel = ExpertParallel(degree=2, rank=1, group_name="ep", data_size=2, data_rank=0,
                              data_group_name="edp", rows=frozenset({rows}))
    plan = make_plan([(rows, (4, 6, 5), torch.float32, True),
                      ("model.norm.weight", (6, 5), torch.float32, True)],
                     PlanRanks(4, rank=1, expert_parallel=parallel),
                     PlanOptions(stage=3, bucket_bytes="blocks"))
    assert plan.holds(rows) and plan.is_expert(rows) and plan.is_expert_rows(rows)
    assert plan.collective_group(rows) == (2, "edp") and plan.shard_rank(rows) == 0
    assert plan.layout(rows).shard_numel == 60 and plan.whole_shape(rows) == (8, 6, 5)
    assert plan.whole_shape("model.norm.weight") == (6, 5)
    assert plan.buckets([rows, "model.norm.weight"]) == [[rows], ["model.norm.weight"]]


def test_experts_held_as_3d_parameters_split_by_rows(fake_world_of_four):
    """transformers 5's layout (tests/support/stacked_experts.py) on a fake world of 4 at EP 2: its
    experts' module is rewritten only because expert parallelism asks for it, rank 0 keeps
    rows 0-3 of the 8 experts, the plan shards them over 2 ranks, the rows travel (two
    exchanges of T*k rows each way), and whole values have the whole shape."""
    from support.stacked_experts import tiny_mixtral_stacked
    from zero_fx import zero_compile
    from zero_fx.capture.experts.routed_experts import route_experts_with_fixed_shapes

    torch.manual_seed(0)
    model = tiny_mixtral_stacked(models.VOCAB, models.SEQ, layers=1)
    assert route_experts_with_fixed_shapes(copy.deepcopy(model)).blocks == []
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = zero_compile(models.language_model_step, stage=3, backend=models.BACKEND,
                        expert_parallel=2)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), models.global_batch("hf_llama", 0)[0])
    [block] = step.moe_blocks
    experts = block.name  # transformers 4: "model.layers.0.block_sparse_moe.experts"
    assert (block.name, block.num_experts, block.top_k, block.stacked) == (experts, 8, 2, True)
    assert step.plan.expert_parallel.rows == {f"{experts}.gate_up_proj", f"{experts}.down_proj"}
    layout = step.plan.layout(f"{experts}.down_proj")
    assert layout.shape == (4, 32, 64) and layout.world_size == 2
    assert model.get_submodule(experts).down_proj.shape == (4, 32, 64)
    tokens = models.global_batch("hf_llama", 0)[0].numel()
    rows = [c for c in step.traffic().collectives
            if c.kind == "all_to_all" and c.dtype.is_floating_point]
    assert [c.numel for c in rows] == [tokens * 2 * 32] * 4  # top-2, width 32
    assert "this rank runs experts 0-3 of each block" in str(step.explain())
    full = step.full_state_dict(cpu_offload=False)
    assert {n: full[n].shape for n in whole} == {n: p.shape for n, p in whole.items()}


def test_experts_held_as_3d_parameters_are_not_read_from_pretrained_weights_yet():
    """load_pretrained would read the whole parameter: refused, saying what to do."""
    from support.stacked_experts import tiny_mixtral_stacked
    from zero_fx.capture.experts.routed_experts import route_experts_with_fixed_shapes

    with torch.device("meta"):
        model = tiny_mixtral_stacked(models.VOCAB, models.SEQ, layers=1)
    blocks = route_experts_with_fixed_shapes(model, expert_parallel=True).blocks  # checked
    assert [b.stacked for b in blocks] == [True]
    with pytest.raises(ValueError, match="load_pretrained does not read a place's rows yet"):
        split_experts(model, blocks, World(size=4, rank=0, group_name="w"), degree=2,
                      loading=True)


def init_own_parameters(module: torch.nn.Module) -> None:
    """An ``init_fn`` for the meta-built test model: each module's own parameters."""
    for param in module.parameters(recurse=False):
        torch.nn.init.ones_(param) if param.dim() == 1 else torch.nn.init.normal_(param, 0, 0.02)


def built_on_meta_rank(rank: int, world_size: int) -> dict:
    """The 3-D-experts Mixtral built on the meta device, sharded with and without expert
    parallelism at stages 3 and 2; its whole values after a step that changes nothing."""
    from support.stacked_experts import tiny_mixtral_stacked
    from zero_fx import zero_compile

    wholes = {}
    for stage in (3, 2):
        for degree in (2, 1):
            torch.manual_seed(0)
            with torch.device("meta"):
                model = tiny_mixtral_stacked(models.VOCAB, models.SEQ, layers=1)
            step = zero_compile(models.language_model_step, stage=stage, backend=models.BACKEND,
                                expert_parallel=degree, init_fn=init_own_parameters)
            batch = models.global_batch("hf_llama", 0)[0].chunk(world_size)[rank]
            step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch)
            experts = model.get_submodule(f"{step.moe_blocks[0].name}") if degree > 1 else None
            wholes[stage, degree] = {"state": step.full_state_dict(cpu_offload=False),
                                     "rows": None if experts is None else
                                     tuple(experts.gate_up_proj.shape)}
    return wholes


def test_experts_held_as_3d_parameters_built_on_the_meta_device():
    """[Note: experts held as 3-D parameters, split by rows]: a meta model is built whole,
    as its construction would, and each place keeps its rows: the whole values at expert
    parallelism 2 are bitwise those without it, at stages 3 and 2 on 2 ranks."""
    for r in run_ranks(2, built_on_meta_rank):
        for stage in (3, 2):
            split, whole = r[stage, 2], r[stage, 1]
            assert split["rows"] == (4, 128, 32)  # 4 of 8 experts, [gate; up] of 64, width 32
            assert whole["state"].keys() == split["state"].keys()
            for key, value in whole["state"].items():
                assert torch.equal(split["state"][key], value), (stage, key)


class GatedProduct(torch.nn.Module):
    def forward(self, gate, up):
        return gate * up


def test_experts_in_a_layout_it_does_not_split_are_named():
    """3-D experts with biases (GPT-OSS's flags), or an activation of gate and up
    (Inkling2's): not rewritten for expert parallelism, and the error says which module and
    why."""
    from support.stacked_experts import tiny_mixtral_stacked
    from zero_fx.capture.experts.routed_experts import route_experts_with_fixed_shapes

    model = tiny_mixtral_stacked(models.VOCAB, models.SEQ, layers=1)
    next(m for n, m in model.named_modules() if n.endswith(".experts")).has_bias = True
    blocks = route_experts_with_fixed_shapes(model, expert_parallel=True).blocks
    assert blocks == []
    with pytest.raises(ValueError, match=r"\.experts holds its experts as 3-D parameters in a "
                                         "layout expert parallelism does not"):
        split_experts(model, blocks, World(size=4, rank=0, group_name="w"), degree=2)
    experts = next(m for n, m in model.named_modules() if n.endswith(".experts"))
    experts.has_bias = False
    experts.act_fn = GatedProduct()  # Inkling2's shape: the check runs it, and says why
    rewrite = route_experts_with_fixed_shapes(model, expert_parallel=True)
    assert rewrite.blocks == []
    with pytest.raises(ValueError, match=r"fixed-shape forward for them fails on a random input "
                                         r"\(TypeError"):
        split_experts(model, rewrite.blocks, World(size=4, rank=0, group_name="w"), degree=2,
                      left_alone=rewrite.unrecognised)


def test_the_shared_expert_runs_while_the_rows_travel(fake_world_of_four):
    """[Note: the dispatch issued, then waited for] in zero_fx/capture/experts/expert_exchange.py:
    DeepSeek-V3's shared expert (three matmuls) sits between the dispatch's issue and its
    wait in the captured graph; the traffic report has the dispatch waited for there."""
    from examples.hf_models import tiny_deepseek_v3
    from zero_fx import zero_compile

    torch.manual_seed(0)
    model = tiny_deepseek_v3(models.VOCAB, models.SEQ)
    step = zero_compile(models.language_model_step, stage=3, backend="aot_eager",
                        expert_parallel=2)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), models.global_batch("hf_llama", 0)[0])
    if step.moe_blocks[0].stacked:
        pytest.skip("transformers 5: the block calls its shared expert after its experts' "
                    "module, whose forward is the one zero_fx rewrites, so nothing of the block "
                    "runs between the dispatch's issue and its wait")
    nodes = list(step.graphs[-1].graph.nodes)
    issued = [i for i, n in enumerate(nodes) if zero_fx_op_name(n.target) == "exchange_rows_issue"]
    waited = [i for i, n in enumerate(nodes) if zero_fx_op_name(n.target) == "exchange_rows_wait"]
    assert len(issued) == len(waited) == 1  # one block with experts, its forward's dispatch
    between = nodes[issued[0]:waited[0]]
    matmuls = [n for n in between if n.op == "call_function" and "mm" in str(n.target)]
    assert len(matmuls) == 3, [n.name for n in between]
    dispatch = next(c for c in step.traffic().collectives
                    if c.kind == "all_to_all" and c.node == nodes[issued[0]].name)
    assert dispatch.waited_at > dispatch.issued_at


# -- the exchange itself, on 2 gloo ranks ------------------------------------------------------

ROUTES = ([0, 0, 0, 0], [0, 0, 1, 3])
"""Each rank's 4 tokens' experts (top-1, sorted), of 4 experts: 2 on rank 0, 2 on rank 1."""


CAPACITY_FACTORS = (None, 1.0)


def exchange_rank(rank: int, world_size: int, capacity_factors: tuple) -> dict:
    """The exchange's outputs and row gradients on this rank, for each capacity factor."""
    from zero_fx.capture.experts.expert_exchange import dispatch_and_combine

    results = {}
    for capacity_factor in capacity_factors:
        experts = torch.tensor(ROUTES[rank])
        rows = (torch.arange(4.0) + 10 * rank + 1).unsqueeze(1).requires_grad_()
        counts = torch.bincount(experts, minlength=4)
        first = 2 * rank

        def run_local_experts(received, offs, group_of_row):  # expert e multiplies by e + 1
            return received * (first + group_of_row + 1).unsqueeze(1).to(received.dtype)

        out = dispatch_and_combine(rows, counts, experts, run_local_experts, degree=2, top_k=1,
                                   group_name=dist.group.WORLD.group_name,
                                   capacity_factor=capacity_factor)
        out.sum().backward()
        results[capacity_factor] = out.detach().squeeze(1).tolist(), rows.grad.squeeze(1).tolist()
    return results


@functools.lru_cache(maxsize=None)
def exchanged() -> list:
    """Every rank's results, both capacity factors in one 2-rank launch (a launch costs
    about 6 s on the 2-core box; the exchanges themselves, milliseconds)."""
    return run_ranks(2, exchange_rank, CAPACITY_FACTORS)


def test_rows_travel_to_their_experts_and_back():
    results = [r[None] for r in exchanged()]
    assert results[0] == ([1, 2, 3, 4], [1, 1, 1, 1])        # all expert 0 (x1)
    assert results[1] == ([11, 12, 26, 56], [1, 1, 2, 4])    # experts 0, 0, 1 (x2), 3 (x4)


def test_an_expert_takes_rows_up_to_its_capacity():
    """Capacity factor 1: each expert takes ceil(1 * 4 tokens * top-1 / 2 local experts) = 2
    rows, peer by peer ([Note: expert capacity]): expert 0 takes rank 0's first two rows and
    none of rank 1's; the rows not taken come back zero, with zero gradients."""
    results = [r[1.0] for r in exchanged()]
    assert results[0] == ([1, 2, 0, 0], [1, 1, 0, 0])
    assert results[1] == ([0, 0, 26, 56], [0, 0, 2, 4])
