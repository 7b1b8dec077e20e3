"""The secondary partition (ZeRO++'s hpZ): the graph a fake world gets, and training over gloo
on 4 ranks as 2 nodes of 2, bitwise as without it."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from support import models
from test_cost_model import tiny_gpt
from support.training import SMALL_BUCKETS, zero_fx_run
from zero_fx import ZeroConfig, rewritten_step_on_fake
from zero_fx.analysis.traffic import traffic_report
from zero_fx.passes.common.predicates import Phase, is_all_gather, phase_of
from zero_fx.runtime.distributed.process_group import World
from zero_fx.runtime.distributed.secondary_groups import with_secondary_partition


@functools.lru_cache(maxsize=None)
def rewritten(**options):
    return rewritten_step_on_fake(tiny_gpt, batch=2, seq=32, vocab_size=128, world_size=8,
                                  resident_max_numel=0, **options)


def gathers(gm) -> Counter:
    return Counter((phase_of(n), n.args[1], n.args[-1]) for n in gm.graph.nodes if is_all_gather(n))


@pytest.mark.parametrize("options", [{}, {"prefetch_buckets": 1}, {"bucket_bytes": 0}],
                         ids=["blocks", "prefetched", "per-parameter"])
def test_the_backward_gathers_within_the_node_from_what_the_forward_kept(options):
    """8 ranks as 4 nodes of 2: each gather the backward repeats is, in the forward, one
    across nodes (4 ranks) and one within the node (2), and in the backward one within the
    node only; a parameter the backward does not gather (the embedding, the head kept
    through the loss) is gathered over every rank as before."""
    plain, _ = rewritten(**options)
    gm, plan = rewritten(secondary_partition=2, **options)
    before, after = gathers(plain), gathers(gm)
    repeated = before[(Phase.BACKWARD, 8, "planned")]
    assert repeated and after == {
        (Phase.FORWARD, 4, "planned-across"): repeated, (Phase.FORWARD, 2, "planned-node"): repeated,
        (Phase.BACKWARD, 2, "planned-node"): repeated,
        (Phase.FORWARD, 8, "planned"): before[(Phase.FORWARD, 8, "planned")] - repeated}
    report = traffic_report(gm, plan)
    by_group = report.wire_bytes_by_group()
    assert set(by_group) == {"shard group", "node group", "across-nodes group"}
    # the forward sends what one gather over every rank sends; the backward 1/2 of each
    # parameter within the node instead of 7/8 of it over every rank
    sizes = {"shard group": 8, "across-nodes group": 4, "node group": 2}
    sent = lambda report, phase: sum(c.bytes * (sizes[c.group] - 1) / sizes[c.group]
                                     for c in report.collectives
                                     if c.kind == "all_gather" and c.phase == phase)
    plain_report = traffic_report(plain, plan)
    assert sent(report, "forward") == pytest.approx(sent(plain_report, "forward"))
    assert sent(report, "backward") == pytest.approx(sent(plain_report, "backward") * 4 / 7)


NODES_OF_TWO = (("secondary_partition", 2),)
COMPOSED = SMALL_BUCKETS + (("recompute", "blocks"),)
"""Several buckets per phase prefetched two ahead, nothing resident, blocks recomputed."""


def test_four_ranks_as_two_nodes_train_bitwise_as_without_it():
    """With buckets, prefetch and recompute: the parameters the backward computes with are
    the same bytes, gathered from the secondary shards within each node."""
    plain = zero_fx_run(4, "gpt", "aot_eager", stage=3, options=COMPOSED)
    secondary = zero_fx_run(4, "gpt", "aot_eager", stage=3, options=COMPOSED + NODES_OF_TWO)
    for with_it, without in zip(secondary, plain):
        assert with_it["losses"] == without["losses"]
        assert all(torch.equal(with_it["params"][n], without["params"][n]) for n in without["params"])
        assert {k: n for k, n in with_it["traffic"].numel_by_kind().items() if n} == \
            {k: n for k, n in with_it["counted"]["numel"].items() if n}


def test_on_a_replicate_shard_mesh_the_shard_dimension_is_the_node():
    """A (2, 2) ("replicate", "shard") mesh with ``secondary_partition=True``: the primary
    shards span the mesh, so it trains bitwise as 4 flat ranks do without it; its backward
    gathers run on the mesh's shard groups."""
    plain = zero_fx_run(4, "gpt", "aot_eager", stage=3, options=COMPOSED)
    on_mesh = zero_fx_run(4, "gpt", "aot_eager", stage=3,
                          options=(("mesh", (2, 2)), ("secondary_partition", True)) + COMPOSED)
    for with_it, without in zip(on_mesh, plain):
        assert with_it["losses"] == without["losses"]
        assert all(torch.equal(with_it["params"][n], without["params"][n]) for n in without["params"])
    groups = {c.group for c in on_mesh[0]["traffic"].collectives if c.phase == "backward"
              and c.kind == "all_gather"}
    assert groups == {"node group"}


@pytest.mark.parametrize("options, message", [
    ({"secondary_partition": 1}, "secondary_partition must be the number of ranks per node"),
    ({"secondary_partition": "node"}, "an int >= 2"),
    ({"secondary_partition": 2, "stage": 2}, "stage 2 gathers none in the step: use stage=3"),
    ({"secondary_partition": 2, "expert_parallel": 2}, "not supported"),
])
def test_options_that_cannot_work_are_refused_with_what_to_do(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


FOUR = World(size=4, rank=0, group_name="0")


@pytest.mark.parametrize("world, value, message", [
    (FOUR, 3, "does not split the 4 ranks into several nodes: give a divisor of 4 below it"),
    (FOUR, 4, "one node needs no secondary partition: leave it unset"),
    (FOUR, True, "LOCAL_WORLD_SIZE, which is not set"),
    (World(size=2, rank=0, group_name="1", replicas=2, replicate_group_name="2"), 4,
     "the mesh's 'shard' dimension is the node, so give secondary_partition=True \\(or 2\\)"),
])
def test_ranks_that_do_not_split_into_nodes_are_refused(world, value, message, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=message):
        with_secondary_partition(world, value, FOUR)


def test_true_on_one_node_has_nothing_to_partition(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with caplog.at_level("INFO", logger="zero_fx"):
        assert with_secondary_partition(FOUR, True, FOUR) is FOUR
    assert "every gather already stays in the node" in caplog.text
