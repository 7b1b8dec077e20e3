"""Every difference between the torch releases zero_fx supports, in one place.

zero_fx runs on torch ``SUPPORTED_TORCH`` (and transformers ``SUPPORTED_TRANSFORMERS`` for
the Hugging Face models). This module is the only one that reads a version string: the
range check at import. Each difference below is probed (does the API take this?), not
dated, and carries a note: what changed, in which release, how zero_fx handles both.

[Note: Inductor's post-grad pre-pass]
``torch._inductor.config.post_grad_custom_pre_pass`` takes one ``CustomGraphPass`` in torch
2.11 and a pass or a sequence of them from 2.12 on (``get_custom_graph_passes``). zero_fx
runs its own passes after the user's, so it hands Inductor one pass that runs them all in
order (``one_post_grad_pass``), which both releases take; its ``uuid`` combines theirs, so
Inductor's FX graph cache keys on every one of them.

[Note: what differs between torch releases]
Each difference met between 2.11, 2.13 and 2.15, and where it is handled (every fix holds on
all three, so none reads a version):

- Inductor's post-grad pre-pass: one pass in 2.11, a pass or a sequence from 2.12
  (``one_post_grad_pass`` below, [Note: Inductor's post-grad pre-pass]).
- A symbolic size through ``F.linear`` on a 3-D input: 2.11's C++ ``linear`` reads it as an
  int unless the Python dispatcher is on, which pins a "dynamic" graph to one length. The
  dynamic capture enters the Python dispatcher, as ``make_fx``'s symbolic tracing does
  (capture/step_graph.py, ``_trace``).
- A ``control_deps`` dependency on an op that returns several tensors (attention): 2.11's
  Inductor drops it silently, 2.15 flattens it. ``PinSchedule`` depends on one of its
  tensors instead (compiler/pin_schedule.py, ``_one_tensor_of``).
- The size assert in Inductor's generated code: ``assert_size_stride`` in 2.11 and 2.13,
  ``assert_tensor_metadata`` in 2.15; the lowered-memory reader takes both
  (compiler/lowered_memory.py, ``_ASSERT``).
- Dynamo reads ``opt.param_groups`` in a traced step with setup for its compiled optimizer:
  it marks every parameter a static address and writes ``capturable=True`` into each group
  it reconstructs; 2.15 stops the write from reaching the user's dict, 2.11 and 2.13 do not.
  zero_fx turns the setup off while it traces (``optimizer_read_plainly``, [Note: the
  optimizer as dynamo reads it]).
- torch.optim.Muon's iterations on a bf16 matrix: before 2.15 ``grad.bfloat16()`` returns the
  matrix itself and the norm's ``div_`` writes into it (a bf16 parameter without Nesterov: its
  momentum buffer); 2.15 copies. The batched iterations (runtime/update/batched_muon.py)
  stack copies on every release, as 2.15 does; fp32 parameters, the recipe's, are the same on
  all three.
- An outer-product ``bmm`` (``[B,M,1] x [B,1,N]``): 2.13 and 2.15 decompose it into a
  multiply, 2.11 keeps the kernel. ``inductor_keeps_as_kernel`` asks the release's own
  decomposition table, so each release is read as it lowers.

[Note: what differs between transformers 4 and 5]
Met by the version matrix (bench/helpers/version_matrix.py) on transformers 4.57.6 and 5.24:

- ``no_init_weights``, the context that builds a model without initialising its weights,
  moved from ``transformers.modeling_utils`` (4.x) to ``transformers.initialization`` (5.x).
  The planner builds models on the meta device inside it; ``hf_no_init_weights`` below finds
  it where the installed release keeps it.
- 5.x records outputs a model is asked for (the router's logits of Mixtral and Qwen3-MoE,
  for their load-balancing loss) with forward hooks it installs on the first forward that
  asks, under a ``threading.Lock`` Dynamo cannot trace: the step broke the graph there.
  ``hf_install_output_hooks`` installs them before the first capture (4.x has no such
  hooks), so the traced forward finds them in place. Which modules record is read from
  ``_CAN_RECORD_REGISTRY``, keyed by the class's ``str`` before 5.24 and by the module from
  5.24: read one way only, the hooks went uninstalled on 5.5-5.23 and every Mixtral step
  broke its graph (met on a GPU machine's transformers).
- The mixture-of-experts families hold their experts as fused 3-D parameters in 5.x:
  docs/moe.md says how each family stands under each release.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Iterable, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..errors import UnsupportedTorchError

SUPPORTED_TORCH = ((2, 11), (2, 16))
"""torch releases zero_fx supports: from the first (inclusive) to the second (exclusive)."""
SUPPORTED_TORCH_TEXT = "torch>=2.11,<2.16"
SUPPORTED_TRANSFORMERS_TEXT = "transformers>=4.57,<6"


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string: ``"2.13.0+cpu"`` -> ``(2, 13)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def torch_version() -> str:
    """This torch's version string, for what records it (a saved step's fingerprint)."""
    return torch.__version__


def check_torch(version: Optional[str] = None) -> None:
    """Raise ``UnsupportedTorchError`` naming the supported range unless ``version`` (default:
    the installed torch's) is in it: a clear error at import, not a failure deep in a pass."""
    version = torch.__version__ if version is None else version
    low, high = SUPPORTED_TORCH
    if not low <= release(version) < high:
        raise UnsupportedTorchError(
            f"zero_fx supports {SUPPORTED_TORCH_TEXT}; this environment has torch {version}. "
            f"Install a supported torch (pip install \"{SUPPORTED_TORCH_TEXT}\"), or a zero_fx "
            f"release made for torch {version}.")


class _PassesInOrder(CustomGraphPass):
    """Several post-grad passes as the one pass Inductor takes ([Note: Inductor's post-grad
    pre-pass])."""

    def __init__(self, passes: Iterable[Any]):
        self.passes = tuple(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Optional[Any]:
        uuids = tuple(p.uuid() if hasattr(p, "uuid") else None for p in self.passes)
        return None if any(u is None for u in uuids) else uuids


def hf_no_init_weights():
    """transformers' ``no_init_weights()`` context, from where the installed release keeps it
    ([Note: what differs between transformers 4 and 5])."""
    try:
        from transformers.initialization import no_init_weights  # 5.x
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # 4.x
    return no_init_weights()


def hf_install_output_hooks(model: torch.nn.Module) -> None:
    """Install transformers 5's output-capturing hooks on every HF model in ``model`` that
    records outputs, as its first forward would ([Note: what differs between transformers 4
    and 5]); nothing under 4.x, or for a model that is not a transformers one. The hooks
    record only while a forward asks for outputs, so installing them changes no result.
    Where transformers was never imported, no model is one of its: nothing is imported
    (transformers' import takes about 1.2 s, a tenth of a small model's first call)."""
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.utils.output_capturing import (_CAN_RECORD_REGISTRY,
                                                         maybe_install_capturing_hooks)
    except ImportError:  # transformers 4, or none
        return
    for module in model.modules():
        if _outputs_it_records(_CAN_RECORD_REGISTRY, module):
            maybe_install_capturing_hooks(module)


def _outputs_it_records(registry: Any, module: torch.nn.Module) -> Optional[dict]:
    """What ``module`` records, from transformers' registry: a dict keyed by the class's
    ``str`` before 5.24, a registry (a dict subclass) that takes the module itself from 5.24."""
    if type(registry) is dict:
        return registry.get(str(module.__class__))
    return registry.get(module)


def one_post_grad_pass(existing: Any, ours: Iterable[CustomGraphPass]) -> CustomGraphPass:
    """The user's post-grad pre-pass(es) (``existing``, Inductor's config value: None, a pass,
    or a sequence of them), then ``ours``, as one pass ([Note: Inductor's post-grad
    pre-pass])."""
    if existing is None:
        users = ()
    elif isinstance(existing, (list, tuple)):
        users = tuple(existing)
    else:
        users = (existing,)
    return _PassesInOrder((*users, *ours))


@contextlib.contextmanager
def optimizer_read_plainly():
    """While zero_fx traces a step, dynamo reads ``opt.param_groups`` as any attribute.

    [Note: the optimizer as dynamo reads it]
    Dynamo wraps an optimizer in ``OptimizerVariable``, which prepares a step it compiles
    itself: on reading ``param_groups`` it marks every parameter a static address (with a
    guard) and sets ``capturable=True`` in each group it tracks. zero_fx never lets dynamo
    trace ``opt.step()`` (the step only records it: runtime/update/deferred_optimizer.py), so that
    setup has nothing to prepare, and it does harm where a step reads or writes a group (a
    learning rate set by hand, as nanoGPT sets it):

    - the groups dynamo writes back hold ``capturable=True`` (2.11, 2.13), and torch.optim's
      next Adam or AdamW step on the CPU fails its capturable assertion;
    - at stage 0 the optimizer holds the model's own parameters, which dynamo then reads as
      static constants of the graph, and the capture fails ("convert all Tensors to
      FakeTensors first").

    Inside this context the setup is skipped: 2.11 and 2.13 (``var_getattr`` handles the
    name) and 2.15 (``tp_getset``) alike fall through to the generic attribute read, so the
    groups are plain dicts to dynamo, their writes replayed as any dict's."""
    from torch._dynamo.variables import optimizer as dynamo_optimizer
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

    cls = dynamo_optimizer.OptimizerVariable
    saved = {name: cls.__dict__[name] for name in ("tp_getset", "var_getattr")
             if name in cls.__dict__}
    if "tp_getset" in saved and "param_groups" in saved["tp_getset"]:
        cls.tp_getset = {k: v for k, v in saved["tp_getset"].items() if k != "param_groups"}
    if "var_getattr" in saved:
        own = saved["var_getattr"]

        def var_getattr(self, tx, name):
            if name == "param_groups":
                return UserDefinedObjectVariable.var_getattr(self, tx, name)
            return own(self, tx, name)

        cls.var_getattr = var_getattr
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cls, name, value)
