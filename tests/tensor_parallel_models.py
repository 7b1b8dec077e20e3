"""A GPT whose layers split over a "tp" mesh dimension with PyTorch's own tensor-parallel
API, and its training on a ("shard", "tp") mesh: the runs of the tensor-parallel tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from training import STEPS

HEADS, WIDTH, LAYERS = 4, 32, 2


class Attention(nn.Module):
    """Separate q, k, v (a fused qkv does not split by columns into heads) and ``-1`` heads
    in the views, so the same code runs on a rank's local heads."""

    def __init__(self):
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """No biases, as the parity tests' GPT (examples/gpt.py's GPTConfig.bias says why)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
        self.attn = Attention()
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(models.VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, models.VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def parallelize(model: GPT, tp_mesh, sequence_parallel: bool = False) -> GPT:
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


def build_model(name: str):
    """``"gpt"``: this file's GPT; ``"hf_llama"``: tests/models.py's tiny HuggingFace Llama."""
    return build() if name == "gpt" else models.build(name)


def step_of(name: str):
    def training_step(model, opt, x, y):
        loss = models.loss_fn(name, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return training_step


OPTIMIZER = "sgd"
"""SGD with momentum: it moves each element by its gradient, so a gradient of the wrong scale
(a tp-replicated one summed over "tp") fails parity; AdamW's m / sqrt(v) hides the scale and
turns the rounding of a near-zero gradient element into a whole step (measured: AdamW 1.7e-5
at (2, 2) against 3.7e-6 flat; SGD 5e-8 both)."""


def reference_run(name: str = "gpt", max_grad_norm=None) -> dict:
    """Plain single-process PyTorch on the whole global batch; ``max_grad_norm``: clipped
    with ``clip_grad_norm_`` (its norms before clipping are the run's ``grad_norms``)."""
    model = build_model(name)
    opt = models.make_optimizer(model, OPTIMIZER)
    losses, norms = [], []
    for i in range(STEPS):
        x, y = models.global_batch(name, i)
        loss = models.loss_fn(name, model, x, y)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def tensor_parallel_rank(rank: int, world_size: int, shape: tuple, stage: int = 3,
                         sequence_parallel: bool = False, options: tuple = (),
                         name: str = "gpt", checkpoint: str = "") -> dict:
    """STEPS steps of model ``name`` parallelized over a ("shard", "tp") mesh of ``shape``
    (("replicate", "shard", "tp") for three sizes), each shard group's ranks on their slice
    of the global batch, in ``accumulation_steps`` calls per step when the options say so;
    whole parameters at the end. ``checkpoint``: saved there after the last step."""
    from torch.distributed.device_mesh import init_device_mesh

    from zero_fx import zero_compile

    names = ("replicate", "shard", "tp")[-len(shape):]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model(name)
    if shape[-1] > 1:
        if name == "gpt":
            parallelize(model, mesh["tp"], sequence_parallel)
        else:
            parallelize_hf_llama(model, mesh["tp"])
    opt = models.make_optimizer(model, OPTIMIZER)
    step = zero_compile(step_of(name), stage=stage, mesh=mesh,
                        **{"backend": "aot_eager", **dict(options)})
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
    return {"losses": losses, "grad_norms": norms, "params": step.full_parameters(),
            "traffic": step.traffic(), "explain": str(step.explain()),
            "counted": {"numel": dict(counted.numel), "launches": dict(counted.launches)}}


def loaded_rank(rank: int, world_size: int, shape: tuple, path: str, resave: str,
                stage: int = 3) -> dict:
    """The GPT on a mesh of ``shape`` (None: no mesh, world size 1), the checkpoint at ``path``
    loaded before the first call, saved again at ``resave``: its whole parameters."""
    from zero_fx import zero_compile

    mesh = None
    model = build()
    if shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp")[-len(shape):])
        if shape[-1] > 1:
            parallelize(model, mesh["tp"])
    opt = models.make_optimizer(model, OPTIMIZER)
    step = zero_compile(step_of("gpt"), stage=stage, backend="aot_eager", mesh=mesh)
    step.load_checkpoint(path, model, opt)
    step.save_checkpoint(resave)
    return {"params": step.full_parameters(), "state_dict": step.full_state_dict(cpu_offload=True)}
