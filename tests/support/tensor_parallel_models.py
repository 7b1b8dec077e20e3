"""The tensor-parallel tests' runs: tests/support/models.py's ``tp_gpt`` (or HF Llama) split over a
"tp" mesh dimension with PyTorch's own tensor-parallel API, trained on a ("shard", "tp")
mesh.

The optimizer is SGD with momentum: it moves each element by its gradient, so a gradient
of the wrong scale (a tp-replicated one summed over "tp") fails parity; AdamW's
m / sqrt(v) hides the scale and turns the rounding of a near-zero gradient element into a
whole step (measured: AdamW 1.7e-5 at (2, 2) against 3.7e-6 flat; SGD 5e-8 both). The
reference is feature_runs.reference_run(name, "sgd")."""

from __future__ import annotations

import functools

from support import models
from support.training import STEPS


@functools.lru_cache(maxsize=None)
def device_mesh(shape: tuple):
    """The CPU mesh of ``shape`` (("replicate", "shard", "tp") for three sizes), made once per
    process: the runs of one launch (``in_turn``) share it. A second mesh of the same shape
    in one process gets new groups while its ``mesh["tp"]`` hands back the first one's, so
    zero_compile would refuse the model parallelized over it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp")[-len(shape):])


def parallelize(model, tp_mesh, sequence_parallel: bool = False):
    """Megatron's split: q, k, v and up by columns, o and down by rows; with
    ``sequence_parallel`` the norms run on a rank's slice of the sequence too (the
    embedding's output and the blocks' outputs split along it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if not sequence_parallel:
        per_block = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                     "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                     "up": ColwiseParallel(), "down": RowwiseParallel()}
        top = {}
    else:
        seq = Shard(1)
        per_block = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                     "attn.q": ColwiseParallel(input_layouts=seq),
                     "attn.k": ColwiseParallel(input_layouts=seq),
                     "attn.v": ColwiseParallel(input_layouts=seq),
                     "attn.o": RowwiseParallel(output_layouts=seq),
                     "up": ColwiseParallel(input_layouts=seq),
                     "down": RowwiseParallel(output_layouts=seq)}
        top = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
               "ln_f": SequenceParallel(),
               "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, per_block)
    if top:
        parallelize_module(model, tp_mesh, top)
    return model


def parallelize_hf_llama(model, tp_mesh):
    """HuggingFace Llama's layers split as Megatron splits them: q, k, v, gate and up by
    columns, o and down by rows (its attention reshapes to ``-1`` heads)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {**{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)
    return model


OPTIMIZER = "sgd"


def tensor_parallel_rank(rank: int, world_size: int, shape: tuple, stage: int = 3,
                         sequence_parallel: bool = False, options: tuple = (),
                         name: str = "tp_gpt", checkpoint: str = "") -> dict:
    """STEPS steps of model ``name`` parallelized over a ("shard", "tp") mesh of ``shape``
    (("replicate", "shard", "tp") for three sizes), each shard group's ranks on their slice
    of the global batch, in ``accumulation_steps`` calls per step when the options say so;
    whole parameters at the end. ``checkpoint``: saved there after the last step."""
    from zero_fx import zero_compile

    mesh = device_mesh(shape)
    model = models.build(name)
    if shape[-1] > 1:
        if name == "tp_gpt":
            parallelize(model, mesh["tp"], sequence_parallel)
        else:
            parallelize_hf_llama(model, mesh["tp"])
    opt = models.make_optimizer(model, OPTIMIZER)
    step = zero_compile(models.training_step(name), stage=stage, mesh=mesh,
                        **{"backend": models.BACKEND, **dict(options)})
    calls = dict(options).get("accumulation_steps", 1)
    data_ranks = world_size // shape[-1]
    data_rank = rank // shape[-1]
    losses, norms = [], []
    for i in range(STEPS):
        x, y = models.global_batch(name, i)
        per_call = x.shape[0] // data_ranks // calls
        call_losses = []
        for call in range(calls):
            start = (data_rank * calls + call) * per_call
            with step.counting_collectives() as counted:
                call_losses.append(step(model, opt, x[start:start + per_call],
                                        y[start:start + per_call]).item())
        losses.append(sum(call_losses) / calls)
        norms.append(step.last_grad_norm.item() if step.last_grad_norm is not None else None)
    if checkpoint:
        step.save_checkpoint(checkpoint)
    return {"losses": losses, "norms": norms, "params": step.full_parameters(),
            "traffic": step.traffic(), "explain": str(step.explain()),
            "counted": {"numel": dict(counted.numel), "launches": dict(counted.launches)}}


def loaded_rank(rank: int, world_size: int, shape: tuple, path: str, resave: str,
                stage: int = 3) -> dict:
    """The GPT on a mesh of ``shape`` (None: no mesh, world size 1), the checkpoint at ``path``
    loaded before the first call, saved again at ``resave``: its whole parameters."""
    from zero_fx import zero_compile

    mesh = None
    model = models.build("tp_gpt")
    if shape is not None:
        mesh = device_mesh(shape)
        if shape[-1] > 1:
            parallelize(model, mesh["tp"])
    opt = models.make_optimizer(model, OPTIMIZER)
    step = zero_compile(models.training_step("tp_gpt"), stage=stage, backend=models.BACKEND,
                        mesh=mesh)
    step.load_checkpoint(path, model, opt)
    step.save_checkpoint(resave)
    return {"params": step.full_parameters(), "state_dict": step.full_state_dict(cpu_offload=True)}
