"""``zero_compile``: the public entry point."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, TypeVar, Union

import torch

from .compiled_step import CompiledStep
from .config import (DEPRECATED_OPTIONS, DebugOptions, ZeroConfig, old_names_in_errors,
                     translate_deprecated)
from .inspection.explain import Explanation, GraphBreakExplanation
from .config import DEFAULT_RESIDENT_MAX_NUMEL, BackendName, Compiler
from .config.options import POLICY_FIELDS
from .config.policies import (FLAT_FIELDS, FLAT_NAMES, MixedPrecision, OffloadPolicy, QuantizationPolicy,
                              RecomputePolicy, SchedulePolicy)


if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("zero_fx")

_F = TypeVar("_F", bound=Callable)


def _called_as_written(declared: _F) -> _F:
    """``zero_compile`` with ``declared``'s signature, types and docstring (what editors, type
    checkers and ``help()`` show), given its keywords as the caller wrote them: an option
    given with its default value is still given ([Note: options given as keywords])."""
    signature = inspect.signature(declared)

    @functools.wraps(declared)
    def zero_compile(*args, **keywords):
        signature.bind(*args, **keywords)  # a TypeError for what the signature refuses
        return _zero_compile(*args, **keywords)

    return zero_compile  # type: ignore[return-value]


@_called_as_written
def zero_compile(
    fn: Optional[Callable] = None,
    *,
    config: Optional[ZeroConfig] = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]] = None,
    stage: int = 3,
    backend: Union[BackendName, Compiler] = "inductor",
    regional: bool = True,
    dynamic_shapes: str = "auto",
    on_graph_break: str = "eager",
    schedule: Optional[SchedulePolicy] = None,
    bucket_bytes: Union[int, str, None] = None,
    prefetch_buckets: int = 1,
    reduce_overlap_buckets: int = 1,
    max_gathered_bytes: Optional[int] = None,
    resident_max_numel: int = DEFAULT_RESIDENT_MAX_NUMEL,
    keep_resident: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
    elementwise_optimizer: Optional[bool] = None,
    passes: Sequence = (),
    mixed_precision: Optional[MixedPrecision] = None,
    accumulation_steps: int = 1,
    max_grad_norm: Optional[float] = None,
    optimizer_update: str = "auto",
    init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
    recompute: Union[None, str, Callable[[torch.fx.Node], str], RecomputePolicy] = None,
    activation_budget_fraction: Optional[float] = None,
    activation_budget_bytes: Optional[int] = None,
    mesh: Optional["DeviceMesh"] = None,
    expert_parallel: int = 1,
    expert_capacity_factor: Optional[float] = None,
    offload: Union[None, str, OffloadPolicy] = None,
    device_memory: Optional[int] = None,
    offload_update: str = "auto",
    offload_step: str = "sync",
    quantization: Optional[QuantizationPolicy] = None,
    quantize_weights: Union[None, str, Mapping[str, Optional[str]]] = None,
    quantize_gradients: Optional[str] = None,
    quantize_block: int = 256,
    secondary_partition: Union[None, bool, int] = None,
    saved_steps: bool = True,
    debug: DebugOptions = DebugOptions(),
    **deprecated: Any,
) -> Union["CompiledStep", Callable[[Callable], "CompiledStep"]]:
    """Compile a whole training step (forward, ``loss.backward()``, ``opt.step()``) with ZeRO.

    Use as ``@zero_compile``, ``@zero_compile(stage=3, backend="aot_eager")`` or
    ``@zero_compile(config=ZeroConfig(...))``::

        @zero_compile(stage=3)
        def train_step(model, opt, x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

    On the first call the model is sharded over the default process group (or
    a world of one if none is initialised) and the step is captured as one
    graph, rewritten with the stage's collectives, and compiled:

    - stage 0 keeps model and optimizer as they are and all-reduces gradients;
    - stages 1-2 keep whole parameters; the optimizer is rebound to flat 1/N
      slices; gradients are reduce-scattered (stage 1 at the end of backward,
      stage 2 as each is produced); the updated slices are all-gathered back
      into the parameters after the optimizer step;
    - stage 3 also frees the parameters' storage: each is all-gathered right
      before its forward use and again before its backward use.

    Args:
        config: a ``ZeroConfig`` holding the options below. Keyword options given with it
            override the fields it leaves at their defaults; a keyword for a field the
            config sets to something else raises ``ValueError``.
        model, optimizer: name them when the step closes over them instead of
            taking them as arguments; ``optimizer=[muon, adamw]`` for several, each stepped
            once per call (docs/optimizers.md).

    Options: each is a keyword here and is documented once, where it is stored (``help(
    ZeroConfig)`` and ``help`` of its policy; the FSDP2 and DeepSpeed settings closest to
    each are in docs/comparison.md):

    - ``ZeroConfig``'s own fields: ``stage``, ``backend``, ``regional``, ``dynamic_shapes``,
      ``on_graph_break``, ``resident_max_numel``, ``keep_resident``,
      ``elementwise_optimizer``, ``passes``, ``accumulation_steps``, ``max_grad_norm``,
      ``optimizer_update``, ``init_fn``, ``mesh``, ``expert_parallel``,
      ``expert_capacity_factor``, ``secondary_partition``, ``saved_steps``;
    - ``schedule=SchedulePolicy(...)``, or its flat options ``bucket_bytes``,
      ``prefetch_buckets``, ``reduce_overlap_buckets``, ``max_gathered_bytes``;
    - ``offload=OffloadPolicy(...)``, or ``offload`` (its mode), ``device_memory``,
      ``offload_update``, ``offload_step`` (docs/offload.md);
    - ``quantization=QuantizationPolicy(...)``, or ``quantize_weights``,
      ``quantize_gradients``, ``quantize_block`` (docs/quantization.md);
    - ``recompute=RecomputePolicy(...)``, or ``recompute`` (its mode),
      ``activation_budget_fraction``, ``activation_budget_bytes``;
    - ``mixed_precision=MixedPrecision(...)`` and ``debug=DebugOptions(...)``.

    A policy and one of its flat options together is an error. ``step.config`` holds the
    policies (``step.config.offload.step``).

    The names of 0.1 (``zero_fx.config.DEPRECATED_OPTIONS``) still work for one release,
    with a ``FutureWarning``: ``memory_budget_bytes`` -> ``max_gathered_bytes``;
    ``persistence_threshold`` -> ``resident_max_numel``; ``activation_memory_budget`` ->
    ``activation_budget_fraction`` / ``activation_budget_bytes``; ``prefetch`` ->
    ``prefetch_buckets`` and ``reduce_overlap_buckets``; ``pin_schedule``,
    ``disable_passes``, ``dump_dir``, ``check_ranks`` -> ``debug=DebugOptions(...)``
    (``**deprecated`` takes them).

    Inspect a compiled step with ``step.explain()``, ``step.traffic()``,
    ``step.estimate()`` and ``step.graphs``.

    The step must call ``loss.backward()`` (more than once sums the gradients, as eager
    does, reduced once after the last), ``opt.step()`` once and
    ``opt.zero_grad()`` (checked before anything compiles; ``CaptureError`` otherwise);
    the optimizer steps after the compiled graph, on the shards, and so do an LR
    scheduler's ``step()``, ``GradScaler`` and ``clip_grad_norm_``/``clip_grad_value_``
    called in the step ([Note: the optimizer's companions] in runtime/update/companions.py).
    ``print``, logging calls and ``.item()`` run after the graph, with its values
    ([Note: host effects after the graph] in capture/host_effects.py). Returned tensors are
    detached (the backward has already run). Outside the step, stage 3's parameters hold
    no values: run the model in ``with step.gathered_parameters():``, or decorate an
    evaluation step: a function that takes the model and no optimizer runs forward only,
    on the shards of the model's training step, with that step's options
    ([Note: evaluation steps] in zero_fx/evaluation.py).
    """


def _zero_compile(fn: Optional[Callable] = None, *, config: Optional[ZeroConfig] = None,
                  model: Optional[torch.nn.Module] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None, **options: Any):
    """``zero_compile`` with the options the caller gave, as written.

    [Note: options given as keywords]
    ``zero_compile`` lists every option with its default, but what it passes on is the
    keywords the caller wrote: an option given with the value of its default still
    counts as given. Next to ``config=``, a keyword repeating the default for a field the
    config sets otherwise is an error, not a silent no-op; an evaluation step's given
    options are checked against its training step's ([Note: evaluation steps] in
    zero_fx/evaluation.py).
    """
    config = _config_from(config, options)

    def wrap(step_fn: Callable) -> "CompiledStep":
        return CompiledStep(step_fn, config, model=model, optimizer=optimizer,
                            given=frozenset(FLAT_FIELDS.get(name, (name,))[0] for name in options))

    return wrap(fn) if fn is not None else wrap


def _config_from(config: Optional[ZeroConfig], options: dict) -> ZeroConfig:
    """``config`` with the keyword ``options`` (new or renamed names) applied: a keyword may
    set a field the config leaves at its default, or repeat the config's value."""
    known = {f.name for f in dataclasses.fields(ZeroConfig)} | set(FLAT_FIELDS)
    unknown = [name for name in options if name not in known and name not in DEPRECATED_OPTIONS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*known, *DEPRECATED_OPTIONS], n=1)
        raise TypeError(f"zero_compile got an unknown option {unknown[0]!r}"
                        + (f" (did you mean {near[0]!r}?)" if near else "")
                        + f"; the options are ZeroConfig's fields: {', '.join(sorted(known))}")
    with old_names_in_errors(options):
        return _configured(config, translate_deprecated(options, stacklevel=4))


def _configured(config: Optional[ZeroConfig], options: dict) -> ZeroConfig:
    """``config`` with the keyword ``options`` set (flat options, or policies given whole);
    an option given as a keyword that the config sets to something else is an error."""
    if config is None:
        return ZeroConfig(**options)
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zero_fx.ZeroConfig(...), got {type(config).__name__}")
    default = ZeroConfig()
    changes = {}
    for name, value in options.items():
        if name in POLICIES and (name not in FLAT_FIELDS or isinstance(value, POLICIES[name])):
            if value is not None or name == "debug":
                changes[name] = _merged_policy(name, getattr(config, name), value,
                                               getattr(default, name))
            continue
        keyword, field = FLAT_FIELDS.get(name, (None, None))
        ours, initial = ((getattr(getattr(config, keyword), field),
                          getattr(getattr(default, keyword), field)) if keyword
                         else (getattr(config, name), getattr(default, name)))
        if not _same(ours, initial) and not _same(ours, value):
            raise ValueError(f"{name} is set both in config= ({ours!r}) and as a keyword "
                             f"({value!r}); set it in one place")
        changes[name] = value
    for name in changes:
        keyword = FLAT_FIELDS.get(name, (None,))[0]
        if keyword not in (None, name) and isinstance(changes.get(keyword), POLICIES[keyword]):
            raise ValueError(f"{name} is set both as a keyword and in {keyword}=: set it in "
                             "one place")
    return config.replaced(**changes) if changes else config


POLICIES = {"debug": DebugOptions, **POLICY_FIELDS}
"""The options merged field by field with a ``config=``'s: a keyword sets the fields the
config leaves at their defaults."""


def _merged_policy(name: str, configured: Any, given: Any, default: Any) -> Any:
    """The policy ``name`` of a ``config=`` with the fields ``given`` as keywords set."""
    cls = POLICIES[name]
    if not isinstance(given, cls):
        raise TypeError(f"{name} must be a zero_fx.{cls.__name__}(...), got {type(given).__name__}")
    changes = {}
    for f in dataclasses.fields(cls):
        value, ours = getattr(given, f.name), getattr(configured, f.name)
        if _same(value, getattr(default, f.name)) or _same(value, ours):
            continue
        if not _same(ours, getattr(default, f.name)):
            option = FLAT_NAMES[name][1][f.name] if name in FLAT_NAMES else f"{name} {f.name}"
            raise ValueError(f"{option} is set both in config= ({ours!r}) and as a keyword "
                             f"({value!r}); set it in one place")
        changes[f.name] = value
    return dataclasses.replace(configured, **changes) if changes else configured


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # values without a plain ==, a tensor or a mesh: only identity counts
        return False


def explain(step: "CompiledStep", hardware="cpu-gloo"
            ) -> Union[Explanation, GraphBreakExplanation]:
    """``step.explain(hardware)``: what zero_fx did to a compiled step."""
    if not isinstance(step, CompiledStep):
        raise TypeError(f"explain takes a step decorated with @zero_compile, got "
                        f"{type(step).__name__}")
    return step.explain(hardware)
