"""Collectives kept at a world of one (``DebugOptions.keep_collectives_at_world_one``; [Note:
collectives kept at a world of one] in zero_fx/runtime/distributed/process_group.py), on a real gloo group
of one rank in this process: each kind a world of N issues is in the rewritten graph and runs,
the traffic report and the counter agree with the graph, and the parameters are the step's
without the option bit for bit; quantized collectives are a quantize-dequantize round trip of
what they move. The NCCL group of one is tests/test_cuda.py's."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from support import models
from support.ranks import gloo_world_of_one
from support.training import relative_error, update_errors
from zero_fx import DebugOptions, zero_compile
from zero_fx.passes.common.predicates import is_token_exchange
from zero_fx.passes.common.quantized_code import dequantize_rows, quantize_rows
from zero_fx.runtime.distributed.process_group import World, keeping_collectives

KEEP = DebugOptions(keep_collectives_at_world_one=True)
STEPS = 3
BACKEND = "aot_eager"
NONE_RESIDENT = (("resident_max_numel", 0),)
"""Stage 3: the test GPT's parameters are all below the residency threshold, so by default
they are one bucket gathered once; with none resident each block is gathered in the forward
and again in the backward, bucketed by block and prefetched."""
IN_GRAPH = {0: {"all_reduce"}, 1: {"reduce_scatter"}, 2: {"reduce_scatter"},
            3: {"all_gather", "reduce_scatter"}}
"""The kinds each stage's graph issues; stages 1 and 2 also all-gather the updated shards
after the optimizer, outside the graph."""
_c10d = torch.ops._c10d_functional
KIND = {_c10d.all_gather_into_tensor.default: "all_gather",
        _c10d.reduce_scatter_tensor.default: "reduce_scatter",
        _c10d.all_reduce.default: "all_reduce", _c10d.all_to_all_single.default: "all_to_all"}
QUANTIZED = (("quantize_weights", "int8"), ("quantize_gradients", "int8"), ("bucket_bytes", 0),
             *NONE_RESIDENT)
"""int8 gathers and reductions, one collective per parameter: each parameter's blocks then
start at its first element, so the reference can round-trip each alone."""
QUANTIZED_TOLERANCE, QUANTIZED_UPDATE_TOLERANCE = 3e-7, 2e-6
"""Quantized at one rank against eager AdamW steps on round-tripped weights and gradients,
after 3 steps: relative error of each parameter, measured 5.6e-8 (blocks.1.attn.proj.weight;
the eager backward sums in another order), and of each update, measured 4.9e-7
(ln_f.weight). The round trip itself moves the parameters 9e-2 from the unquantized
step's."""


def build(model_name: str) -> torch.nn.Module:
    if model_name == "mixtral":
        from examples import hf_models

        torch.manual_seed(0)
        return hf_models.tiny_mixtral(models.VOCAB, models.SEQ, layers=1)
    return models.build(model_name)


def skip_unless_experts_are_modules() -> None:
    """The routed-experts tests exchange the rows of transformers 4's Mixtral, whose experts
    are modules zero_fx rewrites; transformers 5 holds them as 3-D parameters, run as
    transformers wrote them without expert parallelism (docs/moe.md)."""
    if any(hasattr(m, "gate_up_proj") for m in build("mixtral").modules()):
        pytest.skip("transformers 5 holds Mixtral's experts as 3-D parameters: "
                    "tests/test_expert_parallel.py splits those by rows")


def step_function(model_name: str):
    return models.language_model_step if model_name == "mixtral" else models.training_step(model_name)


def batch(model_name: str, step: int) -> tuple:
    if model_name == "mixtral":
        return models.global_batch("hf_llama", step)[:1]  # token ids: the model's own loss
    return models.global_batch(model_name, step)


def trained(model_name: str, stage: int, keep: bool, options: tuple) -> dict:
    """``STEPS`` AdamW steps of ``model_name`` at ``stage`` on this process's group, with the
    option or without: the parameters, the traffic report, the graph, the collectives
    counted in the last step, the plan, its ``explain``."""
    model = build(model_name)
    opt = models.make_optimizer(model)
    step = zero_compile(step_function(model_name), stage=stage, backend=BACKEND,
                        debug=DebugOptions(keep_collectives_at_world_one=keep), **dict(options))
    for i in range(STEPS):
        with step.counting_collectives() as counted:
            step(model, opt, *batch(model_name, i))
    return {"params": step.full_parameters(), "traffic": step.traffic(),
            "graph": step.graphs[-1], "counted": counted, "plan": step.plan,
            "explain": step.explain}


@functools.lru_cache(maxsize=None)
def runs(model_name: str, stage: int, options: tuple = ()) -> tuple[dict, dict]:
    """(without the option, with it) on one gloo group of one."""
    with gloo_world_of_one():
        return (trained(model_name, stage, False, options),
                trained(model_name, stage, True, options))


def graph_collectives(gm) -> tuple[Counter, Counter]:
    """Launches and bytes per kind of the functional collectives in ``gm``, read off its
    nodes: an all-gather's output, a reduction's or an all-to-all's input."""
    launches, nbytes = Counter(), Counter()
    for node in gm.graph.nodes:
        kind = KIND.get(node.target)
        if kind is None:
            continue
        buffer = (node if kind == "all_gather" else node.args[0]).meta["val"]
        launches[kind] += 1
        nbytes[kind] += buffer.numel() * buffer.element_size()
    return launches, nbytes


def nonzero(counts) -> Counter:
    return +Counter(counts)


def assert_same_parameters(run: dict, expected: dict) -> None:
    different = [n for n, p in expected["params"].items() if not torch.equal(run["params"][n], p)]
    assert not different, f"not bit for bit: {different}"


def assert_traffic_is_what_ran(run: dict) -> None:
    """The traffic report's collectives in the graph are the graph's, launch for launch and
    byte for byte (expert parallelism's exchanges node for node), and its totals (with the
    runtime's gathers after the optimizer) what the counter saw run in the last step."""
    traffic, counted, graph = run["traffic"], run["counted"], run["graph"].graph
    exchanges = {n.name for n in graph.nodes if is_token_exchange(n)}
    functional = [c for c in traffic.collectives if c.node and c.node not in exchanges]
    launches, nbytes = graph_collectives(run["graph"])
    assert Counter(c.kind for c in functional) == launches
    assert nonzero({kind: sum(c.bytes for c in functional if c.kind == kind)
                    for kind in launches}) == nbytes
    assert {c.node for c in traffic.collectives if c.node in exchanges} == exchanges
    assert nonzero(traffic.launches_by_kind()) == nonzero(counted.launches)
    assert nonzero(traffic.bytes_by_kind()) == nonzero(counted.bytes)


# -- every stage ------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_runs_its_collectives_at_one_rank_and_trains_bit_for_bit(stage):
    plain, kept = runs("gpt", stage, NONE_RESIDENT if stage == 3 else ())
    assert_same_parameters(kept, plain)
    launches, _ = graph_collectives(kept["graph"])
    assert set(nonzero(launches)) == IN_GRAPH[stage]
    after_step = {c.kind for c in kept["traffic"].collectives if c.phase == "after step"}
    assert after_step == ({"all_gather"} if stage in (1, 2) else set())
    assert_traffic_is_what_ran(kept)
    # gloo sums, never averages (pytorch#162338): [Note: divide before the sum]
    assert {n.args[1] for n in kept["graph"].graph.nodes
            if KIND.get(n.target) in ("reduce_scatter", "all_reduce")} == {"sum"}
    # what the option adds: without it one rank issues nothing, and its report says so
    assert not plain["traffic"].collectives and not nonzero(plain["counted"].launches)


def test_stage_3_buckets_prefetches_and_overlaps_at_one_rank_as_at_n():
    """Stage 3's gathers are bucketed by block and issued ahead of their use, and each
    reduction is waited for later than its issue, as at N ranks ([Note: the collective
    schedule] in passes/schedule_collectives.py)."""
    _, kept = runs("gpt", 3, NONE_RESIDENT)
    collectives = kept["traffic"].collectives
    gathers = [c for c in collectives if c.kind == "all_gather"]
    reductions = [c for c in collectives if c.kind == "reduce_scatter"]
    assert any(len(c.bucket) > 1 for c in gathers) and any(len(c.bucket) > 1 for c in reductions)
    assert any(c.waited_at - c.issued_at > 1 for c in gathers)  # prefetched
    assert any(c.waited_at - c.issued_at > 1 for c in reductions)  # overlapped
    assert "collectives kept at a world of one" in str(kept["explain"]())


def test_the_clipping_norm_is_all_reduced_at_one_rank_bit_for_bit():
    """``max_grad_norm``: the norm's all-reduce runs too (the traffic report lists the
    step's collectives, not the clipping's), and the clipped step is the same."""
    plain, kept = runs("gpt", 1, (("max_grad_norm", 0.05),))
    assert_same_parameters(kept, plain)
    assert kept["counted"].launches["all_reduce"] == 1
    assert not plain["counted"].launches["all_reduce"]
    unclipped = runs("gpt", 1)[0]["params"]
    assert any(not torch.equal(p, unclipped[n]) for n, p in kept["params"].items())  # it clips


# -- quantized collectives --------------------------------------------------------------------

def round_tripped(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as an int8 collective of blocks of 256 delivers it at one rank ([Note:
    quantized blocks on the wire] in passes/common/quantized_code.py)."""
    row = tensor.detach().reshape(1, -1)
    return dequantize_rows(quantize_rows(row, "int8", 256), row.shape[1], "int8", 256,
                           tensor.dtype).view(tensor.shape)


def quantized_reference(device: torch.device = torch.device("cpu"), steps: int = STEPS) -> dict:
    """Eager AdamW steps of the test GPT on ``device`` in which every parameter is used as its
    int8 round trip (the gathers) and every gradient is round-tripped before the step (the
    reductions, summed over one rank): what the quantized collectives compute at one rank.
    Parameters before and after, on the CPU."""
    model = models.build("gpt").to(device)
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    opt = models.make_optimizer(model)
    params = list(model.parameters())
    for i in range(steps):
        masters = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.copy_(round_tripped(p))
        models.loss_fn("gpt", model, *(t.to(device) for t in batch("gpt", i))).backward()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
                p.grad = round_tripped(p.grad)
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "initial": initial}


@functools.lru_cache(maxsize=None)
def quantized_runs() -> tuple[dict, dict]:
    with gloo_world_of_one():
        return trained("gpt", 3, True, QUANTIZED), quantized_reference()


def test_quantized_gathers_and_reductions_at_one_rank_are_a_round_trip():
    kept, reference = quantized_runs()
    errors = {n: relative_error(kept["params"][n], p) for n, p in reference["params"].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < QUANTIZED_TOLERANCE, (worst, errors[worst])
    assert max(update_errors([kept], reference).values()) < QUANTIZED_UPDATE_TOLERANCE
    # it bites: quantizing moves the parameters far more than the tolerance
    unquantized = runs("gpt", 3, NONE_RESIDENT)[1]["params"]
    assert min(relative_error(kept["params"][n], p) for n, p in unquantized.items()
               if n in errors) > 100 * QUANTIZED_TOLERANCE
    launches, nbytes = graph_collectives(kept["graph"])
    assert set(nonzero(launches)) == {"all_gather", "all_to_all"}  # reductions as all-to-alls
    assert kept["traffic"].bytes_by_dtype().keys() == {"uint8"}
    assert_traffic_is_what_ran(kept)


# -- routed experts -----------------------------------------------------------------------------

def test_routed_experts_exchange_their_rows_over_a_group_of_one():
    """A Mixtral block's dispatch and combine (and their backward) run as all-to-alls of an
    expert-parallel group of one ([Note: exchanging rows in fixed shapes] in
    zero_fx/capture/experts/expert_exchange.py), bit for bit as the block without them."""
    pytest.importorskip("transformers")
    skip_unless_experts_are_modules()
    plain, kept = runs("mixtral", 3, NONE_RESIDENT)
    assert_same_parameters(kept, plain)
    assert plain["plan"].expert_parallel is None
    assert kept["plan"].expert_parallel.degree == 1
    exchanges = sum(is_token_exchange(n) for n in kept["graph"].graph.nodes)
    assert exchanges == 5  # counts, rows out, rows back; the rows' two again in the backward
    assert kept["traffic"].launches_by_kind()["all_to_all"] == exchanges
    assert set(nonzero(graph_collectives(kept["graph"])[0])) == IN_GRAPH[3]
    assert_traffic_is_what_ran(kept)


# -- where the option makes no sense, or nothing to change ----------------------------------------

def test_without_a_process_group_the_option_is_an_error():
    assert not dist.is_initialized()
    model = models.build("gpt")
    step = zero_compile(models.training_step("gpt"), stage=3, backend=BACKEND, debug=KEEP)
    with pytest.raises(ValueError, match="no process group is initialised: call "
                                         r"zero_fx.init_distributed\(\)"):
        step(model, models.make_optimizer(model), *batch("gpt", 0))


def test_at_more_than_one_rank_the_option_changes_nothing():
    world = World(size=2, rank=0, group_name="w")
    assert keeping_collectives(world, True) is world
    assert keeping_collectives(World(size=1, rank=0, group_name="w"), True).keeps_collectives
