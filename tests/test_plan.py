"""Property tests of the flat layout: every element owned once, equal shards, lossless round trip."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_fx import make_plan
from zero_fx.plan import PlanOptions, PlanRanks
from zero_fx.plan.layout import BLOCKS
from zero_fx.plan.layout import cut_shard

shapes = st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6)


def plan_of(param_shapes, world_size):
    return make_plan(((f"p{i}", s, torch.float32, True) for i, s in enumerate(param_shapes)),
                     PlanRanks(world_size))


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 16))
def test_every_element_is_owned_by_exactly_one_rank(param_shapes, world_size):
    for layout in plan_of(param_shapes, world_size).params:
        owners = [0] * layout.numel
        for rank in range(world_size):
            start, stop = layout.owned_range(rank)
            for i in range(start, stop):
                owners[i] += 1
        assert owners == [1] * layout.numel


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(1, 16))
def test_shards_are_equal_and_offsets_contiguous(param_shapes, world_size):
    plan = plan_of(param_shapes, world_size)
    offset = 0
    for layout, shape in zip(plan.params, param_shapes):
        assert layout.numel == math.prod(shape)
        assert layout.shard_numel * world_size >= layout.numel > (layout.shard_numel - 1) * world_size
        assert layout.shard_offset == offset
        offset += layout.shard_numel
    assert plan.shard_numel == offset
    assert plan.total_numel + plan.padding_numel == plan.shard_numel * world_size


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(1, 16))
def test_reassembling_the_shards_gives_the_parameters(param_shapes, world_size):
    plan = plan_of(param_shapes, world_size)
    for layout, shape in zip(plan.params, param_shapes):
        full = torch.randn(shape)
        shards = [cut_shard(full, layout, rank) for rank in range(world_size)]
        assert all(s.numel() == layout.shard_numel for s in shards)
        assert torch.equal(torch.cat(shards)[: layout.numel].view(shape), full)
        assert torch.count_nonzero(torch.cat(shards)[layout.numel:]) == 0  # padding is zeros


def test_bad_world_sizes_are_rejected():
    import pytest

    with pytest.raises(ValueError, match="world_size"):
        make_plan([("w", (2,), torch.float32, True)], PlanRanks(0))
    with pytest.raises(ValueError, match="rank 3"):
        make_plan([("w", (2,), torch.float32, True)], PlanRanks(2, rank=3))


def test_buckets_follow_blocks_and_residents_a_byte_cap():
    """[Note: buckets by block]: runs of one block each (whatever their bytes); the embedding
    and the head are units of their own; resident parameters (gathered once) are cut by
    RESIDENT_BUCKET_BYTES instead; a byte cap still overrides."""
    names = ["wte.weight", "wpe.weight", "blocks.0.attn.weight", "blocks.0.mlp.weight",
             "blocks.1.attn.weight", "blocks.1.mlp.weight", "blocks.10.attn.weight", "head.weight"]
    shapes = [(name, (64, 64), torch.float32, True) for name in names]
    plan = make_plan(shapes, PlanRanks(2), PlanOptions(bucket_bytes=BLOCKS))
    assert plan.buckets(names) == [["wte.weight"], ["wpe.weight"], names[2:4], names[4:6],
                                   ["blocks.10.attn.weight"], ["head.weight"]]
    assert plan.buckets(names, resident=True) == [names]  # 8 x 16 KiB, under 16 MiB
    assert make_plan(shapes, PlanRanks(2), PlanOptions(bucket_bytes=2 * 64 * 64 * 4)).buckets(names) == [
        names[0:2], names[2:4], names[4:6], names[6:8]]
    with pytest.raises(ValueError, match="'blocks'"):
        make_plan(shapes, PlanRanks(2), PlanOptions(bucket_bytes="layers"))


def test_a_blocks_routed_experts_are_a_unit_of_their_own():
    """[Note: buckets by block]: a mixture-of-experts block's experts (an HF Mixtral's expert
    list) are gathered and reduced apart from the rest of their block."""
    from examples.hf_models import causal_lm, mixtral_config
    from zero_fx.plan import plan_for_module

    with torch.device("meta"):
        model = causal_lm(mixtral_config(64, 16, layers=2, width=32, heads=4, kv_heads=2, ffn=64,
                                         experts=4))
    plan = plan_for_module(model, PlanRanks(2), PlanOptions(bucket_bytes=BLOCKS))
    assert plan.expert_units == {"model.layers.0.block_sparse_moe.experts",
                                 "model.layers.1.block_sparse_moe.experts"}
    names = [n for n, _ in model.named_parameters()]
    buckets = plan.buckets(names)
    for unit in plan.expert_units:
        assert [n for n in names if n.startswith(unit + ".")] in buckets
    attention = [n for n in names if n.startswith("model.layers.0.self_attn.")]
    assert any(set(attention) <= set(bucket) for bucket in buckets)
