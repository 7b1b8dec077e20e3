"""zero_fx: compiler-based ZeRO for PyTorch.

The folders are the stages of a step's life (docs/architecture.md, "The folders"):
``plan`` (who holds which elements), ``runtime`` (the sharded state and what runs around
each call), ``capture`` (the step as one graph), ``passes`` (the rewrites; the repository's
passes/ folder), ``compiler`` (capture, passes and lowering per compilation), ``analysis``
(traffic, memory, cost read off the graph), ``inspection`` (``explain``, dumps),
``checkpoint`` (save, load, export), ``materialize`` (meta-device models, pretrained
weights) and ``planner`` (``python -m zero_fx.plan``, offline).

The modules here, by role:

- the user's options: the ``config`` package (``ZeroConfig``, the policies that group the
  options, the checks that read several, 0.1's names);
- the step: ``api`` (``zero_compile``), ``compiled_step`` (``CompiledStep``), what it holds
  (``step_state``) and shows (``step_inspection``), ``evaluation`` (forward-only steps),
  ``verification`` (``verify``);
- ``models``: the GPT and Llama the examples train and the planner's named models build;
- command lines: ``estimate`` (``python -m zero_fx.estimate``), ``export`` (a checkpoint to
  a plain ``state_dict``);
- leaves every layer may read: ``errors`` (every public error and warning) and the ``base``
  package (``compat``: differences between torch releases; ``logs``; ``formatting``;
  ``collective_backends``), whose modules keep their old paths (``zero_fx.compat``), as
  ``zero_fx.checkpoint_error`` is ``zero_fx.errors``.
"""

from .base.compat import check_torch as _check_torch

_check_torch()  # outside the supported range: an error naming it, before anything else runs

# The command line ``python -m zero_fx.estimate`` is a module named like the function
# ``zero_fx.estimate``. Importing a submodule sets the package's attribute of its name, so a
# later ``import zero_fx.estimate`` would replace the function by the module. Imported here
# first, the module is in sys.modules before the function is bound below, and later imports
# of it leave the attribute alone.
from . import estimate as _estimate_command_line  # noqa: F401  (before the function below)
from .analysis.cost_model import Estimate, estimate
from .analysis.hardware import PRESETS, Hardware
from .api import CompiledStep, explain, zero_compile
from .checkpoint.files import checkpoint_exists
from .compiler.backend import Compilation
from .config import DebugOptions, MixedPrecision, ZeroConfig
from .errors import (CaptureError, CheckpointError, CollectiveFailedError, DistributedSetupError,
                     GraphBreakWarning, InvariantError, MaterializeError, RanksDisagreeError,
                     UnsupportedTorchError)
import importlib as _importlib
import sys as _sys

from .config import checks as _checks, policies as _policies, renamed_options as _renamed_options
from .config.policies import OffloadPolicy, QuantizationPolicy, RecomputePolicy, SchedulePolicy
from .inspection.explain import Explanation
from .base.logs import quiet_torch_probes, set_logs, set_logs_from_environment
from .materialize import load_pretrained
from .passes.pipeline import after, before
from .plan import ParamLayout, PlanOptions, PlanRanks, ShardPlan, make_plan, plan_for_module
from .planner.offline import rewritten_step_on_fake
from .runtime.distributed.init_distributed import Distributed, init_distributed
from .verification import Verification, verify

__version__ = "0.1.0"
"""The release; pyproject.toml's ``version`` says the same (tests/test_api.py checks)."""

__all__ = [
    "__version__",
    "after",
    "before",
    "CaptureError",
    "GraphBreakWarning",
    "CheckpointError",
    "checkpoint_exists",
    "CollectiveFailedError",
    "Compilation",
    "CompiledStep",
    "DebugOptions",
    "Distributed",
    "DistributedSetupError",
    "Estimate",
    "estimate",
    "explain",
    "Explanation",
    "Hardware",
    "init_distributed",
    "InvariantError",
    "load_pretrained",
    "make_plan",
    "MaterializeError",
    "MixedPrecision",
    "OffloadPolicy",
    "ParamLayout",
    "PlanOptions",
    "PlanRanks",
    "plan_for_module",
    "PRESETS",
    "QuantizationPolicy",
    "RanksDisagreeError",
    "RecomputePolicy",
    "rewritten_step_on_fake",
    "SchedulePolicy",
    "UnsupportedTorchError",
    "set_logs",
    "ShardPlan",
    "Verification",
    "verify",
    "zero_compile",
    "ZeroConfig",
]

# old paths of modules that moved into folders, the same modules: the options' (before
# zero_fx/config/ was a package), the base layer's, CheckpointError's old home, and
# runtime/'s update and distributed rooms'
from . import errors as _errors
from .base import (collective_backends as _collective_backends, compat as _compat,
                   formatting as _formatting, logs as _logs)

for _old_name, _module in (("policies", _policies), ("checks", _checks),
                           ("renamed_options", _renamed_options), ("compat", _compat),
                           ("logs", _logs), ("formatting", _formatting),
                           ("collective_backends", _collective_backends),
                           ("checkpoint_error", _errors)):
    _sys.modules[f"{__name__}.{_old_name}"] = _module
    globals()[_old_name] = _module
for _room, _names in (("update", ("graph_update", "deferred_optimizer", "companions",
                                  "precision", "streamed_update", "optimizer_set",
                                  "whole_tensor_updates")),
                      ("distributed", ("init_distributed", "process_group", "cpu_group",
                                       "expert_groups", "secondary_groups", "gloo_all_gather",
                                       "rank_agreement", "failures"))):
    for _old_name in _names:
        _module = _importlib.import_module(f"{__name__}.runtime.{_room}.{_old_name}")
        _sys.modules[f"{__name__}.runtime.{_old_name}"] = _module
        setattr(_sys.modules[f"{__name__}.runtime"], _old_name, _module)

set_logs_from_environment()
quiet_torch_probes()  # torch's "No CUDA runtime is found", on a machine without CUDA
