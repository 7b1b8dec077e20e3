"""Inductor's FX graph cache: the second compilation of the same rewritten step is a hit,
with the user's passes in the pipeline too ([Note: the FX graph cache] in zero_fx/compiler/lower.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from support import models
from support.ranks import run_ranks
from zero_fx import after, zero_compile
from zero_fx.compiler import reuse


def tag_matmuls(gm):
    """A user pass: tags nodes, changes nothing that runs."""
    for node in gm.graph.nodes:
        node.meta["user_pass_saw"] = True


def compile_twice(rank: int, world_size: int):
    results = []
    with fresh_cache():  # an empty cache directory: the first compilation must miss
        for attempt in range(2):
            torch._dynamo.reset()
            reuse.forget_all()  # lowered again, not the kept compilation: the cache is what is tested
            counters.clear()
            model = models.build("mlp")
            opt = models.make_optimizer(model)

            train_step = zero_compile(models.training_step("mlp"), stage=3, backend="inductor",
                                      passes=[after("reduce_grads", tag_matmuls)])

            x, y = models.global_batch("mlp", 0)
            loss = train_step(model, opt, x[rank::world_size], y[rank::world_size])
            results.append({"loss": loss.item(), "inductor": dict(counters["inductor"]),
                            "collectives": len(train_step.traffic().collectives)})
    return results


@pytest.mark.inductor
def test_second_compilation_hits_the_fx_graph_cache():
    for rank, (first, second) in enumerate(run_ranks(2, compile_twice)):
        assert first["collectives"] > 0
        assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1, first
        assert first["inductor"].get("fxgraph_cache_bypass", 0) == 0, first
        assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
        assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
        assert second["loss"] == first["loss"], rank
