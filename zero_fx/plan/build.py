"""Building the shard plan: ``make_plan`` lays parameters out from the ranks they are sharded
over (``PlanRanks``) and what the configuration decides (``PlanOptions``,
``ZeroConfig.plan_options()``); ``plan_for_module`` does it for a module's parameters."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from ..capture.experts.moe_blocks import routed_expert_modules
from .expert_parallel import ExpertParallel
from .layout import BLOCKS, ParamLayout, ShardPlan
from .secondary import SecondaryPartition
from .tensor_parallel import TensorParallel, local_tensor


@dataclass(frozen=True)
class PlanRanks:
    """The ranks a plan lays parameters out over, and the groups its collectives run on
    (each field is the ``ShardPlan`` field of its name)."""

    world_size: int
    rank: int = 0
    group_name: str = ""
    replicas: int = 1
    replicate_group_name: str = ""
    collectives_average: bool = False
    expert_parallel: Optional[ExpertParallel] = None
    tensor_parallel: Optional[TensorParallel] = None
    secondary: Optional[SecondaryPartition] = None
    keeps_collectives_at_one: bool = False


@dataclass(frozen=True)
class PlanOptions:
    """What the plan takes from the configuration: how the passes fuse, order and type the
    collectives (each field but the last two is the ``ShardPlan`` field of its name).
    ``ZeroConfig.plan_options()`` fills it from the user's options; the defaults here are
    the plainest plan (one collective per parameter, nothing ahead, nothing offloaded)."""

    stage: int = 3
    bucket_bytes: Union[int, str] = 0
    prefetch: int = 0
    reduce_overlap_buckets: Optional[int] = None
    memory_budget_bytes: Optional[int] = None
    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    loss_scaled: bool = False
    accumulation_steps: int = 1
    recompute: Any = None
    offload: Optional[str] = None
    offload_step: str = "sync"
    quantize_weights: tuple = (None, None)
    quantize_gradients: Optional[str] = None
    quantize_block: int = 256
    resident_max_numel: int = 0
    """``plan_for_module``, stage 3: parameters of at most this many elements stay resident."""
    keep_resident: Optional[Callable[[str, torch.nn.Parameter], bool]] = None
    """``plan_for_module``, stage 3: ``keep_resident(name, param)`` true keeps it resident too."""

    def __post_init__(self):
        object.__setattr__(self, "quantize_weights", tuple(self.quantize_weights))


_CHOOSING_RESIDENTS = ("resident_max_numel", "keep_resident")
"""``PlanOptions`` fields that choose the resident parameters, not fields of the plan."""


def make_plan(
    named_shapes: Iterable[tuple[str, Sequence[int], torch.dtype, bool]],
    ranks: PlanRanks,
    options: PlanOptions = PlanOptions(),
    *,
    resident: Iterable[str] = (),
    expert_units: Sequence[str] = (),
) -> ShardPlan:
    """Lay out parameters ``(name, shape, dtype, requires_grad)`` over ``ranks``.

    The order of ``named_shapes`` is the order of the flat shard buffer; pass
    ``model.named_parameters()`` order so that every rank agrees. ``options``: how the
    passes fuse, order and type collectives (see ``ShardPlan``). ``resident``: stage 3's
    parameters kept whole for the step; ``expert_units``: the routed experts' modules.
    """
    world_size, rank, expert_parallel = ranks.world_size, ranks.rank, ranks.expert_parallel
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    layouts = []
    offset = 0
    seen = set()
    for name, shape, dtype, requires_grad in named_shapes:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice in the plan")
        seen.add(name)
        numel = math.prod(shape)
        split = expert_parallel is not None and expert_parallel.splits(name)
        group_size = expert_parallel.data_size if split else world_size
        shard_numel = -(-numel // group_size)  # ceil
        held = expert_parallel is None or expert_parallel.holds(name)
        layouts.append(
            ParamLayout(
                name=name,
                shape=tuple(int(s) for s in shape),
                dtype=dtype,
                numel=numel,
                shard_numel=shard_numel,
                shard_offset=offset if held else -1,
                requires_grad=requires_grad,
                world_size=group_size,
            )
        )
        offset += shard_numel if held else 0
    plan = ShardPlan(params=tuple(layouts), expert_units=frozenset(expert_units),
                     **_fields(ranks), **_fields(options, leave_out=_CHOOSING_RESIDENTS))
    resident = frozenset(resident) if plan.params_sharded else frozenset()
    unknown = resident - seen
    if unknown:
        raise ValueError(f"resident parameters {sorted(unknown)} are not in the model")
    _check_schedule(options)
    return dataclasses.replace(plan, resident=resident) if resident else plan


def _fields(record, leave_out: Sequence[str] = ()) -> dict:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
            if f.name not in leave_out}


def _check_schedule(options: PlanOptions) -> None:
    bucket_bytes = options.bucket_bytes
    if not (bucket_bytes == BLOCKS or isinstance(bucket_bytes, int) and bucket_bytes >= 0):
        raise ValueError(f"bucket_bytes must be a number of bytes >= 0 or {BLOCKS!r}, got "
                         f"{bucket_bytes!r}")
    if options.prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {options.prefetch}")
    if options.reduce_overlap_buckets is not None and options.reduce_overlap_buckets < 0:
        raise ValueError(f"reduce_overlap_buckets must be >= 0, got "
                         f"{options.reduce_overlap_buckets}")
    if options.accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {options.accumulation_steps}")


def plan_for_module(module: torch.nn.Module, ranks: PlanRanks,
                    options: PlanOptions = PlanOptions()) -> ShardPlan:
    """Plan ``module``'s unique parameters (tied parameters appear once, by their first name).

    In stage 3 a parameter of at most ``options.resident_max_numel`` elements, or one for
    which ``options.keep_resident(name, param)`` is true, stays resident.
    """
    named = [(n, local_tensor(p), p) for n, p in module.named_parameters()]  # TP: local pieces
    keep_resident = options.keep_resident
    resident = [n for n, local, p in named
                if local.numel() <= options.resident_max_numel
                or (keep_resident and keep_resident(n, p))]
    parallel = ranks.expert_parallel
    rows = parallel.rows if parallel is not None else frozenset()

    def planned_shape(name: str, local: torch.Tensor) -> tuple[int, ...]:
        """A place's rows of experts held as 3-D parameters, which the model still holds
        whole ([Note: experts held as 3-D parameters, split by rows] in expert_parallel.py)."""
        shape = tuple(local.shape)
        return (shape[0] // parallel.degree, *shape[1:]) if name in rows else shape

    return make_plan(
        ((n, planned_shape(n, local), local.dtype, p.requires_grad) for n, local, p in named),
        ranks, options, resident=resident, expert_units=routed_expert_modules(module))
