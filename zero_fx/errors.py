"""Every error and warning zero_fx raises for the user to catch, in one leaf module.

Each is also importable from ``zero_fx`` itself, and from the module that raised it in earlier
releases (``zero_fx.capture.step_graph.CaptureError``, ``zero_fx.runtime.distributed.failures.
CollectiveFailedError``, ...): those names are these classes. By when they are raised:

- importing: ``UnsupportedTorchError`` (a torch outside the supported range);
- joining the job: ``DistributedSetupError``;
- compiling: ``CaptureError`` (the step does not capture as zero_fx needs),
  ``GraphBreakWarning`` (it broke the graph and runs eagerly), ``InvariantError`` (a pass,
  yours or ours, broke the promises of passes/README.md);
- running: ``RanksDisagreeError`` (ranks about to run different graphs),
  ``CollectiveFailedError`` (a peer died, hung or the network broke);
- loading: ``CheckpointError`` (a checkpoint or weight file cannot be loaded),
  ``MaterializeError`` (a meta-device model cannot be given its values).

A leaf: it imports nothing of zero_fx, so every layer, passes/ included, may raise these.
"""

from __future__ import annotations

from typing import Optional


class UnsupportedTorchError(ImportError):
    """zero_fx was imported with a torch outside the range it supports."""


class DistributedSetupError(RuntimeError):
    """The environment or the machine does not allow the requested setup; the message says
    what to change."""


class CaptureError(RuntimeError):
    """The training step does not have the shape zero_fx can shard."""


class GraphBreakWarning(UserWarning):
    """A step broke the graph and runs eagerly (given once per step, at its first break)."""


class InvariantError(AssertionError):
    """A pass produced a graph that breaks an invariant (passes/README.md).

    ``pass_name`` is the pass whose output first broke it, when the pipeline knows
    (``run_pipeline`` checks after every pass): your own pass (``zero_compile(passes=...)``),
    or one of zero_fx's, which is a zero_fx bug: please report it."""

    def __init__(self, message: str, pass_name: Optional[str] = None):
        super().__init__(message)
        self.pass_name = pass_name


class RanksDisagreeError(RuntimeError):
    """The ranks are about to run different graphs; no collective of the step was issued."""


class CollectiveFailedError(RuntimeError):
    """A collective of the step failed: a peer died, hung past the timeout, or the network broke."""


class CheckpointError(RuntimeError):
    """The checkpoint cannot be loaded: incomplete, truncated, corrupted, or for another model."""


class MaterializeError(RuntimeError):
    """A meta model cannot be given values as its normal construction would."""
