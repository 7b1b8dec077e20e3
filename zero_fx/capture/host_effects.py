"""Prints and log lines inside a captured step: recorded while dynamo traces, run on the host
after the step's graph and its optimizer update, with the values the graph computed.

[Note: host effects after the graph]
A training step prints or logs its loss (``print("loss", loss.item())``,
``logger.info("loss %.4f", loss.item())``). Neither can run inside one graph, and dynamo
would break the graph there, which zero_fx cannot (the backward must be in the same graph
as the forward). So, during a call of the step:

- ``print`` (the builtin) is a recorder; a call of a ``logging.Logger`` method
  (``debug``, ``info``, ``warning``, ``error``, ``critical``, ``exception``, ``log`` and
  transformers' ``warning_once``) is traced as a call of the same recorder. Dynamo traces
  the recorder into an append to ``_calls``, a list it then replays after the graph with
  the call's arguments: tensors and ``.item()`` values become graph outputs, strings and
  numbers constants, f-strings are formatted from those outputs.
- ``.item()`` is traced as a graph value (``capture_scalar_outputs``), which capture turns
  into a float64 (or int64) 0-dim tensor the graph returns (``scalar_outputs.py``); dynamo
  converts it back to a Python number on the way out. So ``return loss.item()`` returns a
  float, as eager does.
- after the graph, its host effects, and then the optimizer update, ``run_recorded()``
  makes the real calls in program order, once per call and rank.

Dynamo's own ``reorderable_logging_functions`` does the first part for plain functions
only: it takes neither a ``.item()`` value (a symbolic float) nor a logger's bound method.

What is not eager's: the calls run after the whole step, so a print sits after the
optimizer update in the output, and a tensor printed shows no ``grad_fn`` (the graph's
outputs are detached). Outside dynamo's trace (the graph's run, a thread printing
meanwhile) the recorder prints at once.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_map_only

_calls: list = []
"""What the traced step printed or logged this call: ``(function, args, kwargs)``. Dynamo
guards on its length (empty when a call starts) and replays it after the graph."""

LOGGER_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "critical",
                            "exception", "log", "warning_once", "info_once"})
"""The ``logging.Logger`` methods recorded (``*_once``: transformers' additions)."""

_real_print = builtins.print


def _record(function: Callable, *args: Any, **kwargs: Any) -> None:
    """Traced: note the call for after the graph. Run for real (outside dynamo): call."""
    if torch.compiler.is_dynamo_compiling():
        # the graph's outputs: a tensor the backward consumed leaves the graph detached
        _calls.append((function, *tree_map_only(torch.Tensor, torch.Tensor.detach,
                                                (args, kwargs))))
    else:
        function(*args, **kwargs)


def _print(*args: Any, **kwargs: Any) -> None:
    _record(_real_print, *args, **kwargs)


def _record_logging(logger: logging.Logger, name: str, *args: Any, **kwargs: Any) -> None:
    _record(_LoggerCall(logger, name), *args, **kwargs)


class _LoggerCall:
    """``logger.<name>`` looked up when the call runs (its level may change meanwhile)."""

    def __init__(self, logger: logging.Logger, name: str):
        self.logger, self.name = logger, name

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        getattr(self.logger, self.name)(*args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Inside: prints and logger calls of the traced step are recorded ([Note: host effects
    after the graph]); ``run_recorded()`` runs them."""
    _calls.clear()
    builtins.print = _print
    try:
        with _logger_calls_traced():
            yield
    finally:
        builtins.print = _real_print


def run_recorded() -> None:
    """Run what the step printed and logged, in program order; then forget it."""
    calls = list(_calls)
    _calls.clear()
    for function, args, kwargs in calls:
        function(*args, **kwargs)


def discard_recorded() -> None:
    """Forget what the call recorded (it failed before its effects were due)."""
    _calls.clear()


@contextlib.contextmanager
def _logger_calls_traced() -> Iterator[None]:
    """Dynamo traces a call of a ``logging.Logger`` method as a call of ``_record_logging``
    instead of refusing it (its ``LoggingLoggerVariable.call_method``; a method in
    ``torch._dynamo.config.ignore_logging_functions`` stays ignored)."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.functions import UserFunctionVariable
    from torch._dynamo.variables.misc import LoggingLoggerVariable

    original = LoggingLoggerVariable.call_method

    def call_method(self, tx, name, args, kwargs):
        ignored = torch._dynamo.config.ignore_logging_functions
        method = getattr(self.value, name, None)
        if (name not in LOGGER_METHODS or tx.export or method in ignored
                or getattr(method, "__func__", None) in ignored):
            return original(self, tx, name, args, kwargs)
        recorder = UserFunctionVariable(_record_logging)
        return recorder.call_function(tx, [self, ConstantVariable.create(name), *args], kwargs)

    LoggingLoggerVariable.call_method = call_method
    try:
        yield
    finally:
        LoggingLoggerVariable.call_method = original
