"""The dynamo backend of a compiled step: each compilation captures dynamo's graph as the
whole step (``capture``), runs our passes on it (``passes``), lowers it (``lower``) and
hands dynamo a ``StepRunner`` that feeds it shards."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import logging
import time
from typing import Callable, Optional

import torch
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _make_graph_module

from ..capture.step_calls import WRITES_GROUPS_AFTER_STEP, check_step_calls, traced_calls
from ..capture.kept_captures import has_kept
from ..capture.step_graph import (CHECKPOINTED_META, CaptureError, capture_key_of,
                                  capture_step_graph, fakes_like_dynamo, has_dynamic_shapes)
from ..config import ZeroConfig, describe_backend
from ..inspection.dump import GraphDump
from ..passes import build_pipeline, run_pipeline
from ..passes.common.predicates import LOSS_SCALE_META, grad_slots
from ..runtime.distributed.rank_agreement import graph_signature
from ..runtime.sharding import Sharded
from ..runtime.update.graph_update import why_not_for_capture
from ..runtime.step_runner import StepRunner
from . import reuse, saved_steps
from .compilation import Compilation
from .lower import by_regions, lower
from .progress import CompileProgress

log = logging.getLogger("zero_fx")

RECOMPILES_WARNED_AT = 4
"""The compilation of a step that logs a warning: shapes change more than a few times."""


class StepCompiler:
    """Compiles one step's graphs; ``graphs`` and ``compilations`` are the step's own lists."""

    def __init__(self, step_name: str, config: ZeroConfig, sharded: Sharded, *,
                 graphs: list, compilations: list, observers: list, explain: Callable,
                 forward_only: bool = False):
        self.step_name = step_name
        self.forward_only = forward_only
        """An evaluation step: no backward, no optimizer ([Note: evaluation steps] in
        zero_fx/evaluation.py)."""
        self.config = config
        self.sharded = sharded
        self.graphs = graphs
        """The rewritten graph of each compilation."""
        self.compilations = compilations
        """Each compilation: its wall time, why it happened, the lowered program's order."""
        self.observers = observers
        self.explain = explain
        """The step's ``explain()``, written into the dumps."""
        self._pipeline = (None, None)
        """(plan, our passes for it): built again when offload="auto" changes the plan."""

    def __call__(self, dynamo_gm: GraphModule, example_inputs: list) -> StepRunner:
        # The step's shape first: nothing is captured, rewritten or lowered for a step that
        # would fail after its first call ([Note: checking the step's calls before compiling]).
        if not self.forward_only:
            check_step_calls()
        calls = traced_calls()
        start = time.perf_counter()
        reason = self._why_compiling()
        plan, state = self.sharded.plan, self.sharded.state
        dynamic = has_dynamic_shapes(dynamo_gm)
        update_reason = self._update_after_graph(dynamic)
        names = [state.param_name(t) if isinstance(t, torch.Tensor) else None
                 for t in example_inputs]
        dump = (GraphDump(self.config.debug.dump_dir, self.step_name, plan.rank,
                          len(self.compilations), plan) if self.config.debug.dump_dir else None)
        decided = (self.forward_only, update_reason)
        capture_key = capture_key_of(dynamo_gm, example_inputs, names)
        saved_key, gm, kept = self._saved_step(capture_key, example_inputs, names, dump,
                                               dynamic, decided)
        key = None
        with CompileProgress(self.step_name) as progress:
            if gm is not None:  # [Note: saved steps] in saved_steps.py
                reason += " (a saved step: no capture, no passes)"
                key = saved_key.reuse_key  # later steps of this structure take it lowered
                if kept is not None:
                    lowered = kept.lowered
                    reason += " (lowered for an earlier step of this structure)"
            else:
                with progress.phase("capturing the step as one graph"):
                    gm = capture_step_graph(dynamo_gm, example_inputs, names, capture_key,
                                            self.forward_only)
                key = self._reuse_key(gm, example_inputs, names, dump, dynamic)
                kept = reuse.find(key, plan, self.config, decided) if key else None
                if kept is not None:  # [Note: one compilation per step structure] in reuse.py
                    log.info("zero_fx: %s takes the compilation of an earlier step of its "
                             "structure (no passes, no lowering)", self.step_name)
                    gm, lowered = kept.gm, kept.lowered
                    reason += " (the rewritten, lowered step of an earlier step of this structure)"
                else:
                    with progress.phase(f"rewriting its {len(gm.graph.nodes)} nodes with "
                                        "zero_fx's passes"):
                        gm = self._rewritten(gm, observe=dump.observe if dump else None,
                                             in_graph=not update_reason)
                    if saved_key is not None:
                        saved_steps.save(saved_key, gm, self.step_name)
            plan = self.sharded.plan  # offload="auto" may have offloaded more
            extra_inputs = self._extra_inputs(gm)
            inputs = state.graph_inputs(names, example_inputs) + extra_inputs
            regional = by_regions(self.config.backend, self.config.regional, dynamic)
            if kept is None:
                with progress.phase(f"lowering {len(gm.graph.nodes)} nodes with "
                                    f"{describe_backend(self.config.backend)}"
                                    + (" by regions" if regional else "")):
                    lowered = lower(gm, fakes_like_dynamo(inputs) if dynamic else inputs,
                                    self.config.backend, dynamic=dynamic,
                                    pin_schedule=self.config.debug.pin_schedule,
                                    resident=plan.resident, regional=self.config.regional)
                if key:
                    reuse.keep(key, plan, self.config, decided, gm, lowered)
        if lowered.order.difference:
            log.warning("zero_fx: %s", lowered.order)
        agreement = self.sharded.agreement
        signature = graph_signature(gm, plan) if agreement.group else None
        self.graphs.append(gm)
        self.compilations.append(Compilation(seconds=time.perf_counter() - start, reason=reason,
                                             order=lowered.order, memory=lowered.memory,
                                             program=lowered.program, regions=lowered.regions,
                                             update_reason=update_reason))
        log.info("zero_fx: compiled %s with %s in %.1f s", self.step_name,
                 describe_backend(self.config.backend), self.compilations[-1].seconds)
        if dump:
            if lowered.regions is not None:
                dump.write_regions(lowered.regions)
            dump.finish(self.explain())
        return StepRunner(lowered.run, names, grad_slots(gm), state, self.observers,
                          agreement, signature, extra_inputs, update=self.sharded.update,
                          updates_in_graph=not update_reason,
                          writes_groups_after_step=WRITES_GROUPS_AFTER_STEP in calls)

    def _keyable(self, dump, dynamic: bool) -> bool:
        """A compilation that can be kept or saved: not one that dumps, has dynamic shapes,
        is lowered by a compiler of the user's (which may keep what it was given) or has an
        offload choice still to make (the rewrite moves the state)."""
        choice = self.sharded.offload_choice
        return not (dump or dynamic or (choice is not None and not choice.decided)
                    or not isinstance(self.config.backend, str))

    def _reuse_key(self, gm: GraphModule, example_inputs: list, names: list, dump,
                   dynamic: bool):
        """The structure key of this compilation, or None where it is compiled afresh
        ([Note: one compilation per step structure] in reuse.py). It reads the graph's
        inputs as they are now, before the rewrite."""
        if not self._keyable(dump, dynamic):
            return None
        try:
            return reuse.structure_key(gm, self.sharded.state.graph_inputs(names, example_inputs),
                                       names)
        except reuse.NotReusable as why:
            log.debug("zero_fx: %s compiles afresh: %s", self.step_name, why)
            return None

    def _saved_step(self, capture_key, example_inputs: list, names: list, dump, dynamic: bool,
                    decided: tuple):
        """(where this compilation's saved step lives, the graph loaded from it, the kept
        compilation of an earlier step of this process that loaded it): (None, None, None)
        where saved steps are off or the step cannot be saved, (key, None, None) where it is
        to be compiled and saved. Every rank gives the graph it holds, or none, to the others
        ([Note: saved steps] in saved_steps.py): all of them or none use one."""
        if not saved_steps.enabled(self.config.saved_steps):
            return None, None, None
        key = gm = kept = None
        if self._keyable(dump, dynamic) and not has_kept(capture_key):  # in-process first
            key = saved_steps.saved_step_key(
                self.step_name, capture_key, self.sharded.state.graph_inputs(names, example_inputs),
                names, self.sharded.plan, self.config, decided)
        if key is not None:
            kept = reuse.find(key.reuse_key, self.sharded.plan, self.config, decided)
            gm = kept.gm if kept is not None else saved_steps.load(key, self.step_name)
        mine = _signature_value(gm, self.sharded.plan) if gm is not None else 0
        everyone = self.sharded.agreement.values(mine)  # [mine] where ranks are not compared
        if gm is not None and set(everyone) != {mine}:
            log.info("zero_fx: %s compiles from scratch: not every rank holds the same saved "
                     "step (ranks %s)", self.step_name,
                     ", ".join(str(r) for r, v in enumerate(everyone) if v != mine))
            gm = kept = None
        elif gm is not None and kept is None:
            log.info("zero_fx: %s loaded its saved step %s (no capture, no passes)",
                     self.step_name, key.path)
        return key, gm, kept

    def _why_compiling(self) -> str:
        if not self.compilations:
            return "first call"
        reason = _recompile_reason()
        log.info("zero_fx: recompiling %s (compilation %d): %s", self.step_name,
                 len(self.compilations), reason)
        if len(self.compilations) + 1 == RECOMPILES_WARNED_AT:
            log.warning(
                "zero_fx: %s is compiling for the %dth time (this time: %s). Every new input shape "
                "compiles once (each takes seconds to minutes, and dynamo gives up at "
                "torch._dynamo.config.recompile_limit); pad or bucket batches to a few fixed "
                "shapes, or leave dynamic_shapes='auto' (one dynamic graph for sizes that change). "
                "step.explain() lists every compilation and its reason.",
                self.step_name, RECOMPILES_WARNED_AT, reason)
        return reason

    def _update_after_graph(self, dynamic: bool) -> str:
        """Why this compilation leaves the optimizer's update to after the graph ("" when
        the graph steps it: [Note: the update in the graph] in graph_update.py): what the
        first call decided, or what the captured step shows."""
        if self.forward_only:
            return "an evaluation step has no update"
        update = self.sharded.update
        if not self.sharded.plan.updates_in_graph:
            return update.in_graph.refused
        why = why_not_for_capture(traced_calls(), dynamic, self.config.backend)
        if why is not None and self.config.optimizer_update == "graph":
            raise CaptureError(f"optimizer_update='graph' cannot step the optimizer in the "
                               f"graph: {why}. Use optimizer_update='auto' (or 'eager') to "
                               f"step it after the graph. Nothing was compiled.")
        return why or ""

    @property
    def pipeline(self):
        """Our passes for the step's plan."""
        return self._passes(in_graph=True)

    def _passes(self, in_graph: bool):
        """Our passes for the step's plan (without the update in the graph unless
        ``in_graph``)."""
        plan = self.sharded.plan
        if not in_graph and plan.updates_in_graph:
            plan = dataclasses.replace(plan, updates_in_graph=False)
        if self._pipeline[0] != plan:
            self._pipeline = (plan, build_pipeline(plan, disable=self.config.debug.disable_passes,
                                                   extra=self.config.passes))
        return self._pipeline[1]

    def _rewritten(self, gm: GraphModule, observe, in_graph: bool) -> GraphModule:
        """``gm`` rewritten by our passes. With offload, on the first compilation, its device
        peak chooses where the update runs, and with ``offload="auto"`` the step is rewritten
        again for more offload while that peak is over the budget ([Note: choosing what to
        offload] in zero_fx/runtime/offload_choice.py)."""
        choice = self.sharded.offload_choice
        if choice is None or choice.decided:
            return run_pipeline(gm, self._pipeline_for(gm, in_graph), observe=observe)
        while True:
            tried = _copied(gm) if choice.auto else gm
            tried = run_pipeline(tried, self._pipeline_for(tried, in_graph), observe=observe)
            mode = choice.next_mode(tried, self.sharded.plan, self.sharded.optimizer_state_tensors)
            if mode is None:
                offload = self.config.offload
                self.sharded.choose_update(offload.update, delayed=offload.delayed)
                return tried
            self.sharded.offload_more(mode)

    def _pipeline_for(self, gm: GraphModule, in_graph: bool):
        """Our passes; with ``recompute="blocks"`` when the model checkpoints activations
        itself and the user chose no recompute ([Note: torch.utils.checkpoint in a captured
        step] in inline_checkpoints.py)."""
        plan = self.sharded.plan
        if not gm.meta.get(CHECKPOINTED_META) or plan.recompute is not None:
            return self._passes(in_graph)
        log.info("zero_fx: the model checkpoints %d region(s) with torch.utils.checkpoint; "
                 "zero_fx recomputes them with recompute='blocks'", gm.meta[CHECKPOINTED_META])
        return build_pipeline(dataclasses.replace(plan, recompute="blocks",
                                                  updates_in_graph=plan.updates_in_graph and in_graph),
                              disable=self.config.debug.disable_passes, extra=self.config.passes)

    def _extra_inputs(self, gm: GraphModule) -> list[torch.Tensor]:
        """The graph's inputs after the step's own: the loss scale, if ``scale_loss`` added it."""
        takes_scale = any(n.meta.get(LOSS_SCALE_META) for n in gm.graph.find_nodes(op="placeholder"))
        scaler = self.sharded.scaler
        if scaler is not None and not takes_scale and not self.forward_only:
            raise CaptureError("fp16 loss scaling needs a scalar loss: call loss.backward() on a "
                               "0-dimensional loss, without gradient=")
        return [scaler.scale] if takes_scale else []


# [Note: graph modules that generate their code when it is used]
# A GraphModule generates its Python program when it is made and at every recompile():
# each of our passes calls recompile() once, so a compilation generated the whole step's
# program about a dozen times, and ran one. Dynamo makes the graph it hands a backend a
# lazy one (torch.fx._lazy_graph_module: recompile() only marks it, the code is generated
# when the module is called or its code read), and so does make_fx while dynamo compiles.
# The graph modules we make (a kept capture's copy, the copy offload="auto" rewrites, the
# regional program and its bodies) follow the same switch through _make_graph_module: a
# small GPT's step went from 14 programs generated per compilation to 6, and our part of
# compiling it again (a kept capture) from 0.46-0.52 to 0.21-0.33 s of CPU (medians of 20,
# three runs each). Outside dynamo (the planner's traces, rewritten_step_on_fake) they are
# eager as before.


def _signature_value(gm: GraphModule, plan) -> int:
    """The graph ranks compare ([Note: checking that ranks agree]), as a nonzero 64-bit value."""
    value = int.from_bytes(graph_signature(gm, plan).fingerprint[:8], "little", signed=True)
    return value or 1


def _copied(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` our passes can rewrite while ``gm`` stays as captured (the nodes'
    metadata dicts copied, their values shared; lazy: [Note: graph modules that generate
    their code when it is used])."""
    copy = _make_graph_module(gm, copy_module.deepcopy(gm.graph))
    copy.meta.update(gm.meta)
    return copy


def _recompile_reason() -> str:
    """Why dynamo compiles again: the guard that failed, in dynamo's words."""
    try:  # dynamo records it in its (private) metrics context before calling the backend
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except (ImportError, AttributeError):
        reason = None
    return reason or "unknown (dynamo did not say; TORCH_LOGS=recompiles prints its guards)"
