"""Will it fit? The offline planner behind ``python -m zero_fx.plan``: per-rank memory,
traffic, buckets and step time of a model at a world size, before any memory is spent.

It reads the layout (``zero_fx.plan``) and traces the rewritten step on fake tensors
(``offline``); nothing below it imports it. One module per question:

- ``plan_model``: ``plan_model``, the report of a model; ``question``: the ``Workload`` it
  plans; ``report``: the report's types and the peak;
- ``stages``: each stage's states, traffic and buckets, flat or hybrid over nodes;
- ``working_set``: the step traced at a few blocks and extrapolated to the model's depth;
- the ``features`` room: ``offload``, ``tensor_parallel``, ``expert_parallel``,
  ``quantization``, each option planned and priced, and ``whole_updates``, Muon's owners,
  their work and exchanges (``--optimizer muon``);
- ``printing``: the report as tables; ``table``: the ZeRO paper's table;
- ``cli`` (``python -m zero_fx.plan``) and ``arguments``, the options it shares with
  ``python -m zero_fx.estimate``;
- ``models``: the models known by name, built from zero_fx.models; ``offline``,
  ``on_device``: the rewritten step on fake tensors, as on a GPU.

Old paths, the same modules: ``zero_fx.planner.torch_models`` is ``zero_fx.models``, and
``zero_fx.planner.offload`` (and the other features) the module in ``features/``.
"""

import importlib as _importlib
import sys as _sys

from .. import models as _models

_sys.modules[f"{__name__}.torch_models"] = _models
for _name in ("offload", "quantization", "tensor_parallel", "expert_parallel", "whole_updates"):
    _sys.modules[f"{__name__}.{_name}"] = _importlib.import_module(f"{__name__}.features.{_name}")

