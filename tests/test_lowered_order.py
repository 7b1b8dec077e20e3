"""What runs is what the plan says: the order of collectives and compute in the code Inductor
generates equals the order ``schedule_collectives`` put in the graph
([Note: pinning the schedule through Inductor] in zero_fx/compiler/pin_schedule.py), and its buffers
live no longer than the graph's ([Note: reading buffer lifetimes from generated code] in
zero_fx/compiler/lowered_memory.py).

The Inductor tests run one process with the fake process group at world 2: the graph, its
collectives and Inductor's program are those of a real rank (values are not checked here;
tests/test_parity.py does that under Inductor with real ranks)."""

from __future__ import annotations

import re

import pytest
import torch

from zero_fx import zero_compile
from zero_fx.compiler.lowered_memory import lowered_memory
from zero_fx.compiler.lowered_schedule import COMPUTE, ISSUE, WAIT, Event, lowered_schedule
from zero_fx.analysis.memory_timeline import memory_timeline

from support import models

GENERATED = """
def call(self, args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 2, '0')
    assert_size_stride(buf0, (64, ), (1, ), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
    # Topologically Sorted Source Nodes: [mm], Original ATen: [aten.mm]
    extern_kernels.mm(arg1_1, arg2_1, out=buf1)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf1, buf1, buf1)
    buf3 = buf1; del buf1  # reuse
    torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '0')
    buf4 = torch.ops._c10d_functional.reduce_scatter_tensor.default(reinterpret_tensor(buf2, (8, ), (1, ), 0), 'sum', 2, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf4)
    buf5 = buf3; del buf3  # reuse
    torch.ops._c10d_functional.wait_tensor.default(buf5)
"""


def test_reads_the_order_of_generated_code():
    schedule = lowered_schedule(GENERATED)
    assert schedule.events == (
        Event(ISSUE, 0, "all_gather"), Event(COMPUTE), Event(WAIT, 0), Event(COMPUTE),
        Event(ISSUE, 1, "all_reduce"), Event(ISSUE, 2, "reduce_scatter"), Event(WAIT, 2),
        Event(WAIT, 1))
    assert schedule.anchors_between() == [1, 0, 0]
    assert lowered_schedule("// a C++ wrapper") is None


def test_a_collective_in_place_on_a_waited_buffer_gets_a_number_of_its_own():
    """Hybrid sharding: the all-reduce across replicas runs in place on the buffer its
    reduce-scatter wrote; the next collective must not take the reduce-scatter's number
    (the reader once counted the numbers still held by buffers, and two collectives got 1)."""
    schedule = lowered_schedule("""
def call(self, args):
    buf0 = torch.ops._c10d_functional.reduce_scatter_tensor.default(arg0_1, 'sum', 2, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    torch.ops._c10d_functional.all_reduce_.default(buf0, 'sum', '1')
    buf1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(arg1_1, 'sum', 2, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    torch.ops._c10d_functional.wait_tensor.default(buf1)
""")
    assert schedule.events == (
        Event(ISSUE, 0, "reduce_scatter"), Event(WAIT, 0), Event(ISSUE, 1, "all_reduce"),
        Event(ISSUE, 2, "reduce_scatter"), Event(WAIT, 1), Event(WAIT, 2))


def test_tensor_parallel_collectives_are_no_events_of_zeros_schedule():
    """A tp group's all-reduce in the program (DTensor's, data like a matmul's output) is
    neither an issue nor a wait of the schedule ZeRO's passes planned."""
    schedule = lowered_schedule("""
def call(self, args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 2, '0')
    buf1 = torch.ops._c10d_functional.all_reduce.default(arg1_1, 'sum', '7')
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
""", skip_groups={"7"})
    assert schedule.events == (Event(ISSUE, 0, "all_gather"), Event(WAIT, 0))


def test_reads_the_buffers_of_generated_code():
    """Allocations, collective results, reuse, aliases and an op's tuple of outputs, replayed
    to the byte (fp32 unless stated)."""
    memory = lowered_memory(GENERATED + """
    buf6 = empty_strided_cpu((4, 4), (8, 1), torch.bfloat16)
    # Topologically Sorted Source Nodes: [gelu]
    cpp_fused_gelu_0(buf5, buf6)
    del buf5
    buf7 = torch.ops.aten.native_layer_norm.default(buf6, [4], None, None, 1e-05)
    buf8 = buf7[0]
    assert_size_stride(buf8, (4, 4), (4, 1), 'torch.ops.aten.native_layer_norm.default')
    buf9 = buf7[1]
    assert_size_stride(buf9, (4, 1), (1, 1), 'torch.ops.aten.native_layer_norm.default')
    del buf7
    del buf9
    return (buf8, buf4, buf2)

def get_args():
    arg0_1 = rand_strided((32, ), (1, ), device='cpu', dtype=torch.float32)
""")
    # buf0: all-gather of 64 fp32 (256 B). buf1/3/5 and buf2, buf4: no size stated, not
    # counted. buf6 spans 1 + 3*8 + 3 = 28 bf16 (56 B). The layer norm's outputs, in its
    # input's dtype: buf8 16 bf16 (32 B) and buf9 4 (8 B), the tuple holding buf9 until it
    # is deleted too. Peak: buf0, buf6 and both outputs.
    assert memory.peak_bytes == 256 + 56 + 32 + 8
    assert [(b.name, b.bytes, b.source) for b in memory.alive_at_peak] == [
        ("buf0", 256, ""), ("buf6", 56, "gelu"), ("buf8", 32, ""), ("buf9", 8, "")]
    # torch 2.15 writes the same assert as assert_tensor_metadata, with the dtype
    newer = GENERATED.replace("assert_size_stride(buf0, (64, ), (1, ), ",
                              "assert_tensor_metadata(buf0, (64, ), (1, ), torch.float32, ")
    assert newer != GENERATED
    assert lowered_memory(newer).peak_bytes == lowered_memory(GENERATED).peak_bytes == 256
    assert lowered_memory("// a C++ wrapper") is None
    assert lowered_memory("def call(self, args):\n    buf0 = empty_strided_cpu((s0, 4), (4, 1), "
                          "torch.float32)\n") is None


def compiled_order(stage: int, **options):
    model = models.build("gpt")
    step = zero_compile(models.training_step("gpt"), stage=stage, backend="inductor",
                        bucket_bytes=0, persistence_threshold=0, regional=False, **options)
    x, y = models.global_batch("gpt", 0)
    step(model, models.make_optimizer(model), x[0::2], y[0::2])
    return step, step.compilations[-1].order


@pytest.mark.inductor
@pytest.mark.parametrize("stage, prefetch", [(3, 0), (3, 1), (3, 2), (2, 1)])
def test_inductor_runs_the_planned_schedule(fake_world_of_two, stage, prefetch):
    step, order = compiled_order(stage, prefetch=prefetch)
    planned, lowered = order.planned, order.lowered
    assert lowered is not None, order.note
    # stage 3: a gather per parameter and phase, the tied head's forward gather kept for the
    # backward ([Note: a weight kept through the loss]), a reduce-scatter per gradient
    assert planned.collectives == (43 if stage == 3 else 15) and planned.anchors == 31
    # issue and wait positions: every event in the same order, between the same kernels
    assert lowered.tokens() == planned.tokens(), order.difference
    # per collective: issued before the compute we placed after it, waited after it
    assert lowered.anchors_between() == planned.anchors_between()
    overlapped = sum(n > 0 for n in planned.anchors_between())
    if prefetch:  # the schedule does overlap something, so the check above is not vacuous
        assert overlapped >= (10 if stage == 3 else 5), planned.anchors_between()
    assert "as lowered: Inductor's generated program runs the graph's schedule" in str(step.explain())
    # and Inductor's buffers peak where the graph's tensors do, within 1%: at prefetch 0 the
    # peak is the loss (order_weight_grads moved it there), where Inductor already holds
    # three 8 KiB buffers of the layer norms' backward that it computes inside the forward's
    # layer-norm kernels: 334404 bytes against the graph's 331400 (1.009x)
    lowered_peak = step.compilations[-1].memory.peak_bytes
    assert lowered_peak <= 1.01 * max(memory_timeline(step.graphs[-1]).transient)


@pytest.mark.inductor
def test_without_pinning_inductor_reorders(fake_world_of_two):
    """The check above fails when Inductor's own reordering is let back in."""
    _, order = compiled_order(3, prefetch=1, pin_schedule=False)
    assert order.lowered is not None
    assert order.difference is not None
    assert "does NOT run the graph's schedule" in str(order)


@pytest.mark.inductor
def test_inductor_keeps_stage3_release(fake_world_of_two):
    """Inductor must not undo the release (say, by merging the forward's and the backward's
    gathers of a layer, keeping every parameter whole from forward to backward): on 16 layers
    of 1024 x 1024, one layer per gather bucket, the generated program's buffers peak exactly
    where and as high as the graph's (gradient shards, the layers in use and in flight, one
    layer's full gradient: 38 MiB), 64 MiB of parameters below what a broken release would
    hold."""
    from bench.experiments.stages import mlp_training
    model, opt, step, x = mlp_training(3, "inductor", 1024, 16, bucket_bytes=4 * 2**20,
                                       regional=False)
    step(model, opt, x)
    graph_peak = max(memory_timeline(step.graphs[-1]).transient)
    lowered = step.compilations[-1].memory
    assert lowered.peak_bytes == graph_peak, lowered.summary()
    assert "peaks at 38.0 MiB besides the persistent bytes (1.00x the graph" in str(step.explain())


def test_a_matmul_inductor_decomposes_is_no_anchor():
    """A rotary embedding's ``inv_freq @ positions`` (inner dimension 1) becomes pointwise
    code that Inductor fuses anywhere: the planned schedule must not count it, or the
    generated program of every HuggingFace Llama would read as out of order."""
    from zero_fx.compiler.lowered_schedule import inductor_keeps_as_kernel

    def kept(a_shape, b_shape):
        graph = torch.fx.Graph()
        a, b = graph.placeholder("a"), graph.placeholder("b")
        a.meta["val"], b.meta["val"] = torch.empty(a_shape), torch.empty(b_shape)
        return inductor_keeps_as_kernel(graph.call_function(torch.ops.aten.bmm.default, (a, b)))

    # an outer product: a broadcast multiply where the release's Inductor decomposes it (2.13,
    # 2.15), a kernel where it does not (2.11): read as the release lowers it
    from torch._inductor.decomposition import decompositions
    outer = decompositions[torch.ops.aten.bmm.default](torch.ones(1, 32, 1), torch.ones(1, 1, 256))
    assert kept((1, 32, 1), (1, 1, 256)) == (outer is NotImplemented)
    assert kept((4, 16, 32), (4, 32, 16))


@pytest.mark.inductor
def test_the_gathered_embedding_is_read_once_in_the_forward(fake_world_of_two):
    """Inductor recomputes ``wte[ids] + wpe[pos]`` inside every kernel that reads it unless
    it is stored, and each such kernel reads the gathered embedding: on GPT-2 125M one in
    block 0's layer norm backward kept the forward's gather (147 MiB) alive to the end of
    the backward, 1.24x the graph's peak ([Note: a released gather's readers are stored] in
    zero_fx/compiler/realize_readers.py). Here (the first gather is the tied token embedding):
    without the fix five kernels read it besides the head's matmuls, with it one. (The head's
    matmuls are two: the forward's and, since the gather is kept through the loss, the
    backward's input gradient: [Note: a weight kept through the loss].)"""
    step, _ = compiled_order(3, prefetch=1)
    program = step.compilations[-1].program
    body = program[program.index("def call("):]
    gathered = re.search(r"(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor", body)[1]
    readers = [line.strip() for line in body.splitlines()
               if re.search(rf"\b{gathered}\b", line) and not line.strip().startswith(
                   ("assert", "del ", "torch.ops._c10d_functional", f"{gathered} = "))
               and "# reuse" not in line]
    assert len(readers) == 3, readers
    assert sum(r.startswith("extern_kernels.mm(") for r in readers) == 2, readers


def test_the_readers_of_a_released_gather_are_marked_to_be_stored():
    """On a post-grad-like graph: an embedding of a released gather is stored; a matmul
    reading it is not marked (Inductor stores it anyway), nor what reads a resident."""
    from zero_fx.compiler.realize_readers import REALIZE_META, RELEASED_KEY, StoreReleasedReaders

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    graph = torch.fx.Graph()
    shard, ids, x, resident_shard = (graph.placeholder(n) for n in ("shard", "ids", "x", "r"))
    gathers = []
    for source in (shard, resident_shard):
        gather = graph.call_function(c10d.all_gather_into_tensor.default, (source, 2, "0"))
        gathers.append(graph.call_function(c10d.wait_tensor.default, (gather,)))
    gather.meta["custom"] = {}
    gathers[0].args[0].meta["custom"] = {RELEASED_KEY: True}
    weight = graph.call_function(aten.view.default, (gathers[0], [8, 4]))
    embedding = graph.call_function(aten.embedding.default, (weight, ids))
    matmul = graph.call_function(aten.mm.default, (x, graph.call_function(aten.t.default, (weight,))))
    scaled = graph.call_function(aten.mul.Tensor, (x, gathers[1]))
    graph.output((embedding, matmul, scaled))
    StoreReleasedReaders()(graph)
    assert [n.name for n in graph.nodes if n.meta.get(REALIZE_META)] == [embedding.name]


def test_pinning_pins_copy_ins_and_adds_no_edge_the_data_implies():
    """[Note: a gather's copy-in is pinned with it] and [Note: no edge the data implies], on a
    post-grad-like graph in our order: mm1, mm2 (reads mm1 through a relu), the bucket's
    copy-in and its gather, mm3, the gather's wait."""
    from torch.fx import Graph

    from zero_fx.compiler.pin_schedule import POSITION_KEY, ordering_dependencies

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    graph = Graph()
    a, b, shard_1, shard_2 = (graph.placeholder(n) for n in ("a", "b", "shard_1", "shard_2"))
    mm_1 = graph.call_function(aten.mm.default, (a, b))
    relu = graph.call_function(aten.relu.default, (mm_1,))
    mm_2 = graph.call_function(aten.mm.default, (relu, b))
    copy_in = graph.call_function(aten.cat.default, ([shard_1, shard_2],))
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (copy_in, 2, "0"))
    mm_3 = graph.call_function(aten.mm.default, (a, b))
    wait = graph.call_function(c10d.wait_tensor.default, (gather,))
    graph.output((mm_2, mm_3, wait))
    for position, node in enumerate(graph.nodes):
        node.meta["custom"] = {POSITION_KEY: position}
    dependencies = {node.name: [d.name for d in deps]
                    for node, deps in ordering_dependencies(list(graph.nodes)).items()}
    assert dependencies == {
        # mm_2 reads mm_1: no edge. The copy-in reads only shards: pinned after mm_2 with its
        # gather. The wait reads the gather, but not mm_3, the event before it.
        copy_in.name: [mm_2.name], gather.name: [mm_2.name], mm_3.name: [gather.name],
        wait.name: [mm_3.name]}
