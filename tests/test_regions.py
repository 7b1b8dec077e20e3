"""Regional compilation ([Note: regional compilation] in zero_fx/compiler/regions.py): each
distinct run of compute between collectives is compiled once, however deep the model; the
step's own graph issues and waits for the collectives in its order; training is the same
number for number as the whole-step program's."""

import re

import pytest
import torch

from examples.gpt import GPT, GPTConfig
from support import models
from support.ranks import run_ranks
from support.training import parity_errors, reference_run, zero_fx_run
from zero_fx import zero_compile
from zero_fx.compiler.lowered_schedule import planned_schedule
from zero_fx.passes.common.predicates import is_all_gather, is_collective, is_reduce_scatter, is_wait
from zero_fx.planner.offline import language_model_loss


def _gpt_step(layers: int, **options):
    """A stage-3 step of an example GPT of ``layers`` blocks after one call (aot_eager)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=32,
                          bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @zero_compile(stage=3, backend="aot_eager", persistence_threshold=0, **options)
    def step(model, opt, x, y):
        loss = language_model_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    step(model, opt, x, torch.roll(x, -1, dims=1))
    return step


def test_the_bodies_do_not_grow_with_depth(fake_world_of_two):
    """4 and 8 blocks compile the same three bodies, only the calls grow: the example GPT's
    stage-3 step compiles a block's forward, a block's backward, and the head with the loss
    (the views and copies around them, a gather's copy-out, a bucket's concatenation, and
    runs with little compute run op by op)."""
    shallow, deep = (_gpt_step(n).compilations[0].regions for n in (4, 8))
    assert [(r.nodes, r.phase) for r in shallow.regions] == [(r.nodes, r.phase) for r in deep.regions]
    assert len(deep.regions) == 3, deep
    # per block a call of the forward's body and one of the backward's
    assert deep.calls - shallow.calls == 2 * 4, (shallow, deep)
    blocks = [r for r in deep.regions if len(r.runs_at) == 8]
    assert sorted(r.phase for r in blocks) == ["backward", "forward"], deep
    # the places name the blocks whose gathered parameters each call reads
    assert all(r.runs_at[0 if r.phase == "forward" else -1] == "blocks.0" for r in blocks), deep
    assert all("blocks.7" in r.runs_at for r in blocks), deep
    # compiled nodes stay flat, the graph grows: 8 blocks compile < 1/10 of their graph
    compiled = sum(r.nodes for r in deep.regions)
    assert compiled == sum(r.nodes for r in shallow.regions)
    assert compiled < deep.graph_nodes / 10, deep


def test_the_outer_graph_runs_ops_per_bucket_not_per_parameter(fake_world_of_two):
    """[Note: one op per bucket] (passes/common/collective_code.py) and [Note: views only the body
    reads go in]: from 4 to 8 blocks the step's own graph grows, per block, by its bodies'
    calls, per bucket by its collective and wait and its code's few ops (a gather: one
    concatenation in, one copy out; a reduction: one concatenation in, the division, a
    flatten, one split), and by the short runs left between collectives (each op with at
    most one view): nothing per parameter, of which a block here has 6. Before, each block
    added 104 ops: every parameter's copy-out, shaping and transposes, every gradient's
    flatten and pad."""
    def counts(step):
        nodes = step.graphs[0].graph.nodes
        return (step.compilations[0].regions, sum(1 for n in nodes if is_all_gather(n)),
                sum(1 for n in nodes if is_reduce_scatter(n)))

    (shallow, gathers_4, reductions_4), (deep, gathers_8, reductions_8) = (
        counts(_gpt_step(n)) for n in (4, 8))
    blocks = 4
    gathers, reductions = (gathers_8 - gathers_4) / blocks, (reductions_8 - reductions_4) / blocks
    assert (gathers, reductions) == (2, 1)  # a block's forward and backward gathers, its reduction
    calls = (deep.calls - shallow.calls) / blocks
    short_runs = (deep.outer_ops - shallow.outer_ops) / blocks - reductions  # not the divisions
    bound = gathers * (2 + 2) + reductions * (2 + 4) + calls + 2 * short_runs
    assert (deep.outer_dispatches - shallow.outer_dispatches) / blocks <= bound, deep
    for copying in ("aten.clone", "aten.constant_pad_nd", "aten.cat.", "aten.slice"):
        assert copying not in deep.outer_code, copying  # no per-parameter copy, pad or slice


def test_the_outer_graph_passes_values_that_travel_together_whole(fake_world_of_two):
    """[Note: results passed whole] (zero_fx/compiler/packed_results.py): a gathered
    bucket's copied-out list goes to the body that reads it as one argument, and a body's
    results that one later node reads (a block's saved activations, its weight gradients
    for the bucket's concatenation) come back as one tuple. Per block, besides its ops,
    the outer graph grows by its parameters' inputs, their gradient shards taken apart for
    the optimizer, and a few results read by two nodes: 22 nodes here, where taking every
    result apart made it 47. And a value passed whole has no other reader, so no lifetime
    grows."""
    shallow, deep = (_gpt_step(n).compilations[0].regions for n in (4, 8))
    blocks, parameters = 4, 6
    dispatches = (deep.outer_dispatches - shallow.outer_dispatches) / blocks
    nodes = (deep.outer_nodes - shallow.outer_nodes) / blocks
    assert nodes - dispatches <= 2 * parameters + 10, (nodes, dispatches)
    code = deep.outer_code
    whole = re.findall(r"\bself\.region_\d+\(([^)]*?)(?:, packs = .*?)?, take = (\(\(.*?\)\))\)", code)
    assert whole, "no call takes a list or a bundle whole"
    taken_apart = set()
    for arguments, take in whole:
        names = [a.strip() for a in arguments.split(",")]
        taken_apart |= {names[int(a)] for a, e in re.findall(r"\((\d+), (-?\d+)\)", take)
                        if int(e) >= 0}
    for name in taken_apart:  # defined, read by its one call, released: nothing else
        reads = [line for line in code.splitlines()
                 if re.search(rf"(?<![\w.]){name}\b", line) and not line.strip().startswith(f"{name} = ")]
        assert len(reads) == 1, (name, reads)


def test_the_outer_graph_runs_the_collectives_in_the_graphs_order(fake_world_of_two, tmp_path):
    """No body holds a collective or a wait, and the program that runs (the outer graph)
    issues and waits for them in the rewritten graph's order; explain() and the dumps show
    the bodies and where each runs."""
    step = _gpt_step(3, prefetch=2, dump_dir=str(tmp_path))
    compilation, graph = step.compilations[0], step.graphs[0]
    program = re.findall(r"(\w+) = torch\.ops\._c10d_functional\.(\w+)\.default\(",
                         compilation.regions.outer_code)
    rewritten = [(n.name, n.target._opname) for n in graph.graph.nodes
                 if is_collective(n) or is_wait(n)]
    assert program == rewritten
    assert len(program) >= 20
    for region in compilation.regions.regions:
        assert "_c10d_functional" not in region.code, region.name
    assert planned_schedule(graph).tokens() == compilation.order.planned.tokens()
    text = str(step.explain())
    assert "regional compilation:" in text and "region_0:" in text
    assert "runs as Python and issues and waits for every collective in its order" in text
    dumped = next(tmp_path.rglob("regions.txt")).read_text()
    assert "# the outer graph: it runs as Python, in this order" in dumped
    assert dumped.count("compiled once, called") == len(compilation.regions.regions)


@pytest.mark.parametrize("stage", [1, 3])
def test_regional_trains_as_the_whole_step_bit_for_bit(stage):
    """aot_eager runs the same aten ops either way: the losses and the parameters of 5 steps
    on 2 gloo ranks are equal to the last bit, and both match single-process training."""
    regional = zero_fx_run(2, "gpt", "aot_eager", stage=stage)
    whole = zero_fx_run(2, "gpt", "aot_eager", stage=stage, options=(("regional", False),))
    for a, b in zip(regional, whole):
        assert a["losses"] == b["losses"]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["counted"] == b["counted"]
    errors = parity_errors(regional, reference_run("gpt"))
    assert max(errors.values()) < 1e-5, errors


def test_views_sunk_before_one_reader_stay_after_their_base():
    """Sixty views sunk right before one reader, then two views of another view sunk there
    too: positions must stay exact (float midpoints ran out of bits, tied, and put a view
    after its own reader: a routed-experts block of 32 experts failed to compile)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zero_fx.compiler.compute_runs import sink_views

    def program(x):
        a = x * 2
        t = a.t()
        s0, s1 = t.select(0, 0), t.select(0, 1)
        others = [a.select(1, k) for k in range(60)]
        b = a.sum()
        return torch.cat([s1, s0, *others]) + b

    gm = make_fx(program)(torch.randn(4, 64))
    sink_views(gm)
    gm.graph.lint()  # raises if any node reads one defined after it
    assert torch.equal(gm(torch.ones(4, 64)), program(torch.ones(4, 64)))


def _mixtral_regions(layers: int):
    step, _ = models.mixtral_after_one_step(layers)
    return step.compilations[-1].regions.regions


def test_a_mixture_of_experts_compiles_one_backward_body_for_all_blocks(fake_world_of_two):
    """The router loss concatenates every block's router logits; its backward slices each
    block's part at its own offset. The slice stays outside the bodies and a body does not
    depend on where its input starts, so 2 and 4 blocks compile the same bodies (each block's
    backward was a body of its own)."""
    pytest.importorskip("transformers")
    two, four = _mixtral_regions(2), _mixtral_regions(4)
    assert len(four) == len(two), ([r.nodes for r in two], [r.nodes for r in four])
    biggest = max(four, key=lambda r: r.nodes)
    assert len(biggest.runs_at) == 4, [(r.name, r.nodes, r.runs_at) for r in four]


def test_a_copy_stays_on_its_side_of_a_write_in_place():
    """[Note: copies and writes in place]: a copy that no op of its run reads is moved to the
    run's edge, but not past an op of the run that overwrites what it copies: moved after
    the ``div_``, the clone autograd saves of DeepSeek-V3's router weights copied the
    divided weights; moved before the ``mul_``, a copy of an input (through a
    view) copied it unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zero_fx.compiler.compute_runs import compute_runs

    def saved_before_divided(x, d):
        w = (x.sigmoid() * 2).exp().tanh()
        saved = w.clone()  # read by the backward only, after a collective
        w.div_(d)
        return (w + 1).sum(), saved

    def copied_after_scaled(x, d):
        flat = d.view(-1)
        d.mul_(2)
        y = (x.sigmoid() * d).exp().tanh()
        return y.sum(), flat.clone()  # reads d through a view taken before the mul_

    for program in (saved_before_divided, copied_after_scaled):
        x, d = torch.randn(4, 3), torch.full((4, 1), 3.0)
        gm = make_fx(program)(x.clone(), d.clone())
        expected = program(x.clone(), d.clone())
        assert len(compute_runs(gm)) == 1
        gm.graph.lint()
        gm.recompile()
        for got, want in zip(gm(x.clone(), d.clone()), expected):
            assert torch.equal(got, want), (program.__name__, gm.code)


class InPlaceRouted(torch.nn.Module):
    """The tail of DeepSeek-V3's router: the top-k of sigmoid scores, renormalised in place
    (``topk_weights /= denominator``), so autograd saves a clone of them for the backward."""

    def __init__(self, width: int = 16, experts: int = 4):
        super().__init__()
        self.router = torch.nn.Linear(width, experts, bias=False)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        scores = self.router(x).sigmoid()
        weights = scores.gather(-1, scores.topk(2, dim=-1)[1])
        weights /= weights.sum(-1, keepdim=True)
        return self.proj(x) * weights[..., :1]


def _in_place_routed():
    torch.manual_seed(0)
    return torch.nn.Sequential(InPlaceRouted(), torch.nn.Linear(16, 16))


def _square_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _in_place_routed_rank(rank: int, world_size: int, x: torch.Tensor) -> dict:
    model = _in_place_routed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zero_compile(_square_step, stage=3, backend=models.BACKEND)
    step(model, opt, x.chunk(world_size)[rank])
    return step.full_parameters()


def test_a_weight_divided_in_place_trains_like_eager():
    """DeepSeek-V3's router without transformers: at stage 3 the last layer's gradient is reduced
    between the router's forward and its backward, which cuts the forward's run there; the
    router's update was 18% off (its loss right) while the clone of its weights left the
    body."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    model = _in_place_routed()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    _square_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x)
    for trained in run_ranks(2, _in_place_routed_rank, x):
        for name, expected in model.named_parameters():
            update = expected.detach() - initial[name]
            error = ((trained[name] - expected.detach()).norm() / update.norm().clamp_min(1e-12)).item()
            assert error < 1e-4, (name, error)


def _laid_out_otherwise(result):
    """``result``'s values in column-major order where it has two dimensions to swap."""
    if not isinstance(result, torch.Tensor) or result.dim() < 2 or min(result.shape[-2:]) < 2:
        return result
    return result.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_a_body_result_laid_out_otherwise_reaches_its_readers_as_traced(fake_world_of_two,
                                                                       monkeypatch):
    """[Note: a body's results keep their traced strides]: a compiled body may return a
    result in other strides than the trace's (Inductor did, for the HF Llama's attention
    values), and the body reading it was compiled for the trace's: Inductor asserts them."""
    from zero_fx.compiler import lower

    unexpected, relaid = [], []
    compile_body = lower._compile_body

    def compiling_one_that_lays_out_otherwise(backend, body, values):
        compiled = compile_body(backend, body, values)
        traced = [tuple(v.stride()) for v in values]

        def run(*inputs):
            unexpected.extend(tuple(i.shape) for i, s in zip(inputs, traced)
                              if isinstance(i, torch.Tensor) and i.numel() > 1
                              and tuple(i.stride()) != s)
            results = [_laid_out_otherwise(r) for r in compiled(*inputs)]
            relaid.extend(r for r in results if isinstance(r, torch.Tensor) and not r.is_contiguous())
            return results
        return run

    monkeypatch.setattr(lower, "_compile_body", compiling_one_that_lays_out_otherwise)
    step = _gpt_step(2)
    assert relaid, "no body returned a result it could lay out otherwise: the test tests nothing"
    assert not unexpected, f"bodies read inputs in other strides than traced: {unexpected[:5]}"
    assert step.compilations[-1].regions.calls > 2
