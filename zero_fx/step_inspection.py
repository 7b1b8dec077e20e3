"""What a compiled step shows of itself: the plan, every collective, the cost model's
estimate, the compilations, and observers of its tensor work."""

from __future__ import annotations

import contextlib
from typing import Iterator, Union

from torch.utils._python_dispatch import TorchDispatchMode

from .analysis.collective_counter import CollectiveCounter
from .analysis.cost_model import Estimate, estimate
from .analysis.traffic import TrafficReport, traffic_report
from .capture.experts.moe_blocks import RoutedExperts
from .config import describe_backend
from .base.formatting import ranks_phrase
from .inspection.explain import Explanation, GraphBreakExplanation, explain_graph
from .runtime.update.graph_update import kernels_of


class StepInspection:
    """``CompiledStep``'s inspection methods. A base of ``CompiledStep``: it reads the step's
    ``graphs``, ``compilations``, ``plan``, ``config`` and what its first call set up."""

    @property
    def moe_blocks(self) -> list[RoutedExperts]:
        """The mixture-of-experts blocks given a fixed-shape forward on the first call
        ([Note: routed experts with fixed shapes] in zero_fx/capture/experts/routed_experts.py)."""
        return self._experts.blocks

    @property
    def compile_seconds(self) -> list[float]:
        """Wall time of each compilation: capture, passes and lowering."""
        return [c.seconds for c in self.compilations]

    @contextlib.contextmanager
    def observing(self, mode: TorchDispatchMode) -> Iterator[TorchDispatchMode]:
        """Run the step's tensor work (the compiled graph, then the optimizer) under ``mode``.

        Dynamo will not run compiled code under a Python dispatch mode, so a
        mode entered around the call would never see the graph; this enters it
        inside, around the graph and around the optimizer step. It sees what
        dispatches through Python: everything under aot_eager and eager; under
        Inductor, the collectives (fallback kernels) and the optimizer, but not
        the graph's fused kernels or the buffers its generated code allocates.
        """
        self._observers.append(mode)
        try:
            yield mode
        finally:
            self._observers.remove(mode)

    def counting_collectives(self) -> "contextlib.AbstractContextManager[CollectiveCounter]":
        """``with step.counting_collectives() as counted: step(...)``, then read ``counted.numel``.

        Counts under every backend, Inductor included (it calls collectives as
        fallback kernels, through the dispatcher)."""
        return self.observing(CollectiveCounter(self._tensor_parallel_group))

    def _tensor_parallel_group(self) -> str:
        """The "tp" group's name ("" before the first call, or without tensor parallelism)."""
        parallel = self.plan.tensor_parallel if self._sharded is not None else None
        return parallel.group_name if parallel is not None else ""

    def traffic(self) -> TrafficReport:
        """The collectives one call of the step issues (the latest compilation); print it for a table."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return traffic_report(self.graphs[-1], self.plan,
                              tuple(block.experts for block in self.moe_blocks))

    def estimate(self, hardware="cpu-gloo") -> Estimate:
        """The cost model's step time, exposed communication and peak memory for the latest
        compilation on ``hardware`` (a preset name in ``zero_fx.analysis.hardware.PRESETS`` or a
        ``Hardware``); print it. See [Note: the cost model] in zero_fx/analysis/cost_model.py."""
        if not self.graphs:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        return estimate(self.graphs[-1], self.plan, hardware)

    def explain(self, hardware="cpu-gloo") -> Union[Explanation, GraphBreakExplanation]:
        """What zero_fx did to this step (latest compilation): the plan, every collective
        with where it is issued and waited, each gathered parameter's lifetime, the
        estimated memory over the step and what is alive at its peak, and the
        compilations so far with their reasons. Print it. Times: the cost model on
        ``hardware`` (a preset name or a ``Hardware``). A step that broke the graph and runs
        eagerly: where it broke, why, and what running eagerly costs."""
        if not self.graphs and self._fallback is None:
            raise RuntimeError("the step has not been compiled yet; call it once first")
        plan = self.plan
        of_group = " of its shard group" if plan.replicas > 1 else ""
        title = (f"zero_fx explain: {self.__name__}, stage {plan.stage} over "
                 f"{ranks_phrase(plan.world_size, plan.replicas)} (this is rank {plan.rank}"
                 f"{of_group}), backend {describe_backend(self.config.backend)}")
        if self._fallback is not None:
            fallback = self._fallback
            return GraphBreakExplanation(title, plan, fallback.graph_break, fallback.costs(),
                                         fallback.calls)
        return explain_graph(self.graphs[-1], self.plan, hardware=hardware, title=title,
                             compilations=self.compilations, moe_blocks=self.moe_blocks,
                             offload_choice=self._sharded.offload_choice,
                             update_reason=self.compilations[-1].update_reason
                             if self.compilations else None,
                             update_kernels=kernels_of(self.state.optimizer,
                                                        self._sharded.update.batches),
                             parameter_updates=self.state.updates)
