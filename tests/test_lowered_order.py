"""What runs is what the plan says: the order of collectives and compute in the code Inductor
generates equals the order ``schedule_collectives`` put in the graph
([Note: pinning the schedule through Inductor] in zero_fx/pin_schedule.py).

The Inductor tests run one process with the fake process group at world 2: the graph, its
collectives and Inductor's program are those of a real rank (values are not checked here;
tests/test_parity.py does that under Inductor with real ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from zero_fx import zero_compile
from zero_fx.lowered_schedule import COMPUTE, ISSUE, WAIT, Event, lowered_schedule

import models

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


@pytest.fixture
def fake_world_of_two():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compiled_order(stage: int, **options):
    model = models.build("gpt")
    step = zero_compile(models.training_step("gpt"), stage=stage, backend="inductor",
                        bucket_bytes=0, persistence_threshold=0, **options)
    x, y = models.global_batch("gpt", 0)
    step(model, models.make_optimizer(model), x[0::2], y[0::2])
    return step, step.compilations[-1].order


@pytest.mark.inductor
@pytest.mark.parametrize("stage, prefetch", [(3, 0), (3, 1), (3, 2), (2, 1)])
def test_inductor_runs_the_planned_schedule(fake_world_of_two, stage, prefetch):
    step, order = compiled_order(stage, prefetch=prefetch)
    planned, lowered = order.planned, order.lowered
    assert lowered is not None, order.note
    assert planned.collectives == (44 if stage == 3 else 15) and planned.anchors == 31
    # issue and wait positions: every event in the same order, between the same kernels
    assert lowered.tokens() == planned.tokens(), order.difference
    # per collective: issued before the compute we placed after it, waited after it
    assert lowered.anchors_between() == planned.anchors_between()
    overlapped = sum(n > 0 for n in planned.anchors_between())
    if prefetch:  # the schedule does overlap something, so the check above is not vacuous
        assert overlapped >= (10 if stage == 3 else 5), planned.anchors_between()
    assert "as lowered: Inductor's generated program runs the graph's schedule" in str(step.explain())


@pytest.mark.inductor
def test_without_pinning_inductor_reorders(fake_world_of_two):
    """The check above fails when Inductor's own reordering is let back in."""
    _, order = compiled_order(3, prefetch=1, pin_schedule=False)
    assert order.lowered is not None
    assert order.difference is not None
    assert "does NOT run the graph's schedule" in str(order)
