"""The checks of ``ZeroConfig``'s options that read the stage or each other: each raises an
error that says what to choose instead."""

from __future__ import annotations

from typing import Mapping

from ..passes.common.quantized_code import check_block


def check_expert_parallel(degree, stage: int, mesh, capacity_factor=None) -> None:
    """An expert-parallel degree zero_fx can run, or an error saying what to choose instead."""
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"expert_parallel must be an int >= 1 (ranks each block's experts are "
                         f"split over; 1: none), got {degree!r}")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
                or not capacity_factor > 0:
            raise ValueError(f"expert_capacity_factor must be a number > 0 (each expert's rows "
                             f"as a multiple of an even spread's) or None, got {capacity_factor!r}")
        if degree == 1:
            raise ValueError("expert_capacity_factor bounds the rows expert parallelism sends "
                             "each rank; without it (expert_parallel=1) every rank runs its own "
                             "rows in fixed shapes and drops none: set expert_parallel too, or "
                             "leave the factor out")
    if degree == 1:
        return
    if stage == 0:
        raise ValueError(f"expert_parallel={degree} needs stage 1, 2 or 3: it splits the "
                         f"experts and their optimizer state over ranks, and stage 0 keeps "
                         f"every parameter and its state whole on every rank")
    if mesh is not None and mesh.ndim > 1 and tuple(mesh.mesh_dim_names) != ("replicate", "shard"):
        raise ValueError(f"expert_parallel={degree} on a mesh of dimensions "
                         f"{mesh.mesh_dim_names}: expert parallelism takes a flat world or a "
                         "('replicate', 'shard') mesh, not tensor parallelism")


OFFLOAD_MODES = (None, "optimizer", "parameters", "auto")


def check_offload(policy, stage: int) -> None:
    """An ``OffloadPolicy`` zero_fx runs at ``stage``, or an error saying what to choose
    instead: the one offload check, which ``ZeroConfig`` and the planner (``--offload``)
    both call."""
    mode, device_memory, where, step = policy.mode, policy.device_memory, policy.update, policy.step
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload must be None, 'optimizer', 'parameters' or 'auto', got "
                         f"{mode!r}")
    if mode is not None and stage == 0:
        raise ValueError(f"offload={mode!r} needs stage 1, 2 or 3: stage 0 steps the "
                         "optimizer on the model's own parameters, on the training device")
    if mode == "parameters" and stage != 3:
        raise ValueError(f"offload='parameters' needs stage 3 (got stage {stage}): stages 1-2 "
                         "keep whole parameters on the device; offload='optimizer' moves the "
                         "masters and the optimizer's state")
    if device_memory is not None:
        if mode is None:
            raise ValueError("device_memory is the budget offload='auto' fits the step into (and "
                             "offload_update='auto' chooses by); without offload nothing reads "
                             "it: set offload, or leave device_memory out")
        if isinstance(device_memory, bool) or not isinstance(device_memory, (int, float)) \
                or not device_memory > 0:
            raise ValueError(f"device_memory must be a number of bytes > 0 (80e9 for 80 GB), "
                             f"got {device_memory!r}")
    if where not in ("auto", "host", "device"):
        raise ValueError(f"offload_update must be 'auto', 'host' or 'device', got {where!r}")
    if where != "auto" and mode is None:
        raise ValueError(f"offload_update={where!r} says where an offloaded optimizer steps: set "
                         "offload='optimizer', 'parameters' or 'auto' with it")
    if step not in ("sync", "overlap"):
        raise ValueError(f"offload_step must be 'sync' or 'overlap', got {step!r}")
    if step == "overlap" and where == "device":
        raise ValueError("offload_step='overlap' runs the optimizer on a host thread during the "
                         "next call: it goes with offload_update='host' (or 'auto'), not 'device'")
    if step == "overlap" and mode is None:
        raise ValueError("offload_step='overlap' overlaps the host's optimizer step with the "
                         "next call: it needs offload='optimizer' or 'parameters'")
    if step == "overlap" and mode == "auto":
        raise ValueError("offload_step='overlap' makes every call read parameters one step "
                         "stale, and with offload='auto' whether it applies would depend on "
                         "memory: choose offload='optimizer' or 'parameters' with it")


def check_schedule(policy, blocks: str) -> None:
    """A ``SchedulePolicy`` of sizes and counts zero_fx can use (``blocks``: the name of
    one bucket per block), or an error naming the bad one."""
    for name in ("bucket_bytes", "max_gathered_bytes"):
        value = getattr(policy, name)
        if name == "bucket_bytes" and value == blocks:
            continue
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            also = f", {blocks!r}" if name == "bucket_bytes" else ""
            raise ValueError(f"{name} must be a number of bytes >= 0{also} or None, got {value!r}")
    for name in ("prefetch_buckets", "reduce_overlap_buckets"):
        value = getattr(policy, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


RECOMPUTE_MODES = (None, "blocks", "auto")


def check_recompute(policy) -> None:
    """A ``RecomputePolicy`` zero_fx can run, or an error saying what to choose instead."""
    mode, fraction, nbytes = policy.mode, policy.budget_fraction, policy.budget_bytes
    if mode not in RECOMPUTE_MODES and not callable(mode):
        raise ValueError(f"recompute must be None, 'blocks', 'auto' or a policy "
                         f"fn(node) -> 'save' | 'recompute'; got {mode!r}")
    if fraction is None and nbytes is None:
        return
    name = "activation_budget_fraction" if fraction is not None else "activation_budget_bytes"
    if fraction is not None and nbytes is not None:
        raise ValueError("set activation_budget_fraction or activation_budget_bytes, not both")
    if mode not in (None, "auto"):
        raise ValueError(f"{name} goes with recompute='auto', not recompute={mode!r}")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise ValueError(f"activation_budget_fraction must be a fraction in (0, 1] of the "
                         f"activations; got {fraction!r} (a number of bytes is "
                         f"activation_budget_bytes)")
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                               or nbytes < 1):
        raise ValueError(f"activation_budget_bytes must be a number of bytes >= 1; got "
                         f"{nbytes!r} (a fraction of the activations is "
                         f"activation_budget_fraction)")


WEIGHT_FORMATS = ("int8", "fp8")
GRADIENT_FORMATS = ("int8", "int4")
PHASES = ("forward", "backward")


def weight_formats(quantize_weights) -> tuple:
    """``quantize_weights`` as (the forward's format, the backward's)."""
    if isinstance(quantize_weights, Mapping):
        return tuple(quantize_weights.get(phase) for phase in PHASES)
    return (quantize_weights, quantize_weights)


def check_quantization(policy, stage: int, accumulation_steps: int) -> None:
    """A ``QuantizationPolicy`` that makes sense at ``stage`` ([Note: quantized blocks on the
    wire] in passes/common/quantized_code.py)."""
    weights, gradients, block = policy.weights, policy.gradients, policy.block
    if isinstance(weights, Mapping):
        unknown = set(weights) - set(PHASES)
        if unknown:
            raise ValueError(f"quantize_weights takes the phases {PHASES} as keys, got "
                             f"{sorted(unknown)}")
    for fmt in weight_formats(weights):
        if fmt is not None and fmt not in WEIGHT_FORMATS:
            raise ValueError(f"quantize_weights must be None, one of {WEIGHT_FORMATS} or "
                             f"{{'forward': ..., 'backward': ...}} of them; got {weights!r}"
                             + (" (int4 is for gradients: quantize_gradients='int4')"
                                if fmt == "int4" else ""))
    if any(weight_formats(weights)) and stage != 3:
        raise ValueError(f"quantize_weights quantizes stage 3's gathers of the parameters; "
                         f"stage {stage} keeps whole parameters on every rank and gathers "
                         f"none in the step: use stage=3, or leave quantize_weights unset")
    if gradients is not None and gradients not in GRADIENT_FORMATS:
        raise ValueError(f"quantize_gradients must be None or one of {GRADIENT_FORMATS}, "
                         f"got {gradients!r}")
    if gradients is not None and stage == 0:
        raise ValueError("quantize_gradients quantizes the reduce-scatter of stages 1-3; "
                         "stage 0 all-reduces whole gradients: use stage >= 1")
    if gradients is not None and stage == 1 and accumulation_steps > 1:
        raise ValueError("quantize_gradients quantizes the reductions in the step's graph; "
                         "stage 1 with accumulation_steps > 1 reduces the summed gradients "
                         "outside it, once per optimizer step: use stage 2 or 3 with it")
    check_block(block)


def check_mesh(mesh, stage: int) -> None:
    """A mesh zero_fx can shard over, or a ValueError saying what to build instead."""
    if mesh is None:
        return
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (init_device_mesh), "
                        f"got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return
    names = tuple(mesh.mesh_dim_names or ())
    if names not in MESH_DIM_NAMES:
        raise ValueError(f"mesh must be 1-D (flat sharding) or named {' or '.join(map(str, MESH_DIM_NAMES))} "
                         f"(hybrid sharding, tensor parallelism); got a {mesh.ndim}-D mesh named "
                         f"{mesh.mesh_dim_names}: init_device_mesh(device, (replicas, shards), "
                         f"mesh_dim_names=('replicate', 'shard')), or (shards, tp) named "
                         f"('shard', 'tp') with the model parallelized over mesh['tp']")
    if "tp" in names and stage == 0:
        raise ValueError("stage 0 with a tensor-parallel mesh is not supported: use stage 1, 2 or "
                         "3 (ZeRO over the 'shard' dimension), or a mesh without 'tp'")
    if mesh.size(names.index("shard")) == 1 and stage != 0 and "replicate" in names:
        raise ValueError(f"the mesh's shard dimension has one rank, so stage {stage} would shard "
                         f"nothing: use stage=0 (every rank a replica), or more ranks per shard group")


def check_secondary_partition(secondary_partition, stage: int, mesh, expert_parallel) -> None:
    """``secondary_partition`` makes sense with the rest ([Note: the secondary partition] in
    zero_fx/plan/secondary.py); whether it divides the ranks is checked once the group is
    known (``runtime/distributed/secondary_groups.py``)."""
    if secondary_partition is None or secondary_partition is False:
        return
    if not (secondary_partition is True or isinstance(secondary_partition, int)
            and not isinstance(secondary_partition, bool) and secondary_partition >= 2):
        raise ValueError(f"secondary_partition must be the number of ranks per node (an int >= "
                         f"2), True (torchrun's LOCAL_WORLD_SIZE, or a mesh's 'shard' "
                         f"dimension) or None; got {secondary_partition!r}")
    if stage != 3:
        raise ValueError(f"secondary_partition keeps a node's copy of stage 3's gathered "
                         f"parameters for the backward; stage {stage} gathers none in the step: "
                         f"use stage=3, or leave secondary_partition unset")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "tp" in names:
        raise ValueError("secondary_partition with a tensor-parallel mesh is not supported: use a "
                         "flat world or a ('replicate', 'shard') mesh")
    if expert_parallel != 1:
        raise ValueError("secondary_partition with expert_parallel is not supported: routed "
                         "experts are gathered over their own groups; leave one of them unset")


MESH_DIM_NAMES = (("replicate", "shard"), ("shard", "tp"), ("replicate", "shard", "tp"))
"""The multi-dimensional meshes zero_fx runs on: hybrid sharding ([Note: hybrid sharding] in
zero_fx/runtime/distributed/process_group.py), ZeRO over tensor parallelism, and both."""
