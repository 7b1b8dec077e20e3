"""One training step per peer, each the way that peer's documentation writes it.

Every factory takes the model (built from the same seed on every rank), the
``BenchModel`` and the run's ``Setting``, and returns a ``Trainer`` whose
``step(x, y)`` runs forward, backward and AdamW (or Muon and AdamW: optimizers.py) on this
rank's batch and returns the loss. The peers and what each compiles:

- ``zero_fx-<s>``: ``@zero_compile(stage=s)`` over the whole step (one graph, each
  distinct run of compute compiled once); ``zero_fx-3-whole``: ``regional=False``,
  the whole step as one Inductor program; ``zero_fx-3-cudagraphs``: by regions, each body
  Inductor compiles replayed as a CUDA graph (``torch._inductor.config.triton.cudagraphs``;
  the collectives and the optimizer stay outside; on a CPU it is ``zero_fx-3``);
  ``zero_fx-3-blocks`` / ``zero_fx-3-auto``: with ``recompute="blocks"`` /
  ``recompute="auto"`` (``activation_budget_fraction`` 0.5); ``zero_fx-3-update-after``:
  the optimizer steps after the graph (``optimizer_update="eager"``), where ``zero_fx-3``
  steps each bucket in it as its gradients land; ``zero_fx-3-ep2``: a
  mixture-of-experts model's experts split over 2 ranks (``expert_parallel=2``);
- ``ddp`` / ``ddp-compiled``: ``DistributedDataParallel``; compiled is
  ``torch.compile(DDP(model))`` (forward and backward; dynamo splits the graph at
  DDP's buckets), the optimizer stays eager;
- ``fsdp2`` / ``fsdp2-compiled``: ``fully_shard`` on each block and the root;
  compiled compiles each block before sharding it (the torchtitan recipe);
  ``fsdp2-ac``: each block also checkpoints its activations (torch's composable
  ``checkpoint``, as torchtitan's full activation checkpointing), eager;
- ``deepspeed-<s>``: ``deepspeed.initialize`` with ZeRO stage s, ``engine.backward``
  and ``engine.step``; its buckets, and in stage 3 how many gathered
  parameters it keeps alive, are set to zero_fx's sizes (its own defaults, 5e8
  elements, allocate a 1.9 GiB reduce buffer whatever the model, and keep up to
  1e9 gathered elements for reuse); ``deepspeed-3-ac`` checkpoints each block with
  ``torch.utils.checkpoint`` (what HF's ``gradient_checkpointing_enable`` does under
  DeepSpeed);
- ``torch.compile``: no data parallelism; plain ``torch.compile`` of the same
  whole step (dynamo's ``trace_autograd_ops``) on the whole global batch, so its
  loss agrees with the others. Its compile time is the reference for zero_fx's;
  its step time does the work of every rank in one process.

A mixture-of-experts model (``hf-mixtral``) runs HF's own block in every peer but zero_fx:
its loop over the experts that received tokens. An expert that no token of a rank chose
then has no gradient on that rank, and FSDP2 reduce-scatters only the parameters that have
one (torch 2.13), so the ranks' collectives no longer match and gloo aborts; DDP (without
``find_unused_parameters``) and DeepSpeed also expect every rank to reduce the same
parameters. So those peers call each expert once more per step on no rows
(``_every_expert_takes_part``, which adds an exact zero): a zero gradient for every expert
on every rank, as zero_fx's fixed-shape experts give, for a few empty matmuls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from .models import BenchModel, loss_of
from .optimizers import deepspeed_optimizer, optimizers_of


@dataclass(frozen=True)
class Setting:
    device: torch.device
    backend: str
    """The ``torch.compile`` backend of every compiled peer: inductor, or aot_eager for smoke tests."""
    bf16: bool
    """Compute in bfloat16 with fp32 parameters, gradient reduction and optimizer (GPU mode)."""
    bucket_bytes: Optional[int] = None
    """Cap of a fused collective for zero_fx and DeepSpeed; None: zero_fx's defaults."""
    optimizer: str = "adamw"
    """"adamw", or "muon": Muon on the blocks' matrices, AdamW on the rest (optimizers.py)."""
    muon_iterations: str = "bf16"
    """torch.optim.Muon's Newton-Schulz in its own bf16, or in "fp32"."""


@dataclass
class Trainer:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    whole_batch: bool = False
    """Trains the global batch rather than this rank's share (the torch.compile reference)."""
    zero_fx_step: Optional[Callable] = None
    """The ``@zero_compile`` step, for its traffic report and compile time."""


def _every_expert_takes_part(model: nn.Module) -> None:
    """Each mixture-of-experts block (a module with an ``experts`` ModuleList, as HF's
    sparse blocks) adds to its output the sum of each expert's output on no rows, an exact
    zero: the same values, and a (zero) gradient for every expert, whichever tokens the
    rank routed."""
    def touch_every_expert(block, args, output):
        hidden = args[0] if args else None
        if not isinstance(hidden, torch.Tensor):
            return output
        none = hidden.reshape(-1, hidden.shape[-1])[:0]
        zero = sum(expert(none).sum() for expert in block.experts)
        if isinstance(output, tuple):
            return (output[0] + zero, *output[1:])
        return output + zero

    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.ModuleList) and len(experts) > 1:
            module.register_forward_hook(touch_every_expert)


def _spmd_experts(make: Callable) -> Callable:
    """``make`` with every expert taking part in each step (see the module's note)."""
    def made(model: nn.Module, spec: BenchModel, setting: Setting) -> Trainer:
        _every_expert_takes_part(model)
        return make(model, spec, setting)
    return made


def _optimizers(model: nn.Module, spec: BenchModel, setting: Setting) -> list:
    return optimizers_of(model, spec.blocks(model), setting.optimizer, setting.muon_iterations)


def _autocast(setting: Setting):
    if not setting.bf16:
        return contextlib.nullcontext()
    return torch.autocast(setting.device.type, dtype=torch.bfloat16)


def zero_fx(stage: int, recompute: Optional[str] = None, regional: bool = True,
            expert_parallel: int = 1, cuda_graphs: bool = False, optimizer_update: str = "auto"):
    def make(model: nn.Module, spec: BenchModel, setting: Setting) -> Trainer:
        from zero_fx import MixedPrecision, zero_compile

        if cuda_graphs:  # this peer's process only: every body Inductor compiles from here on
            import torch._inductor.config as inductor_config

            inductor_config.triton.cudagraphs = True

        opts = _optimizers(model, spec, setting)
        precision = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32) if setting.bf16 else None)
        compile_step = zero_compile(
            stage=stage, backend=setting.backend, mixed_precision=precision,
            bucket_bytes=setting.bucket_bytes, recompute=recompute, regional=regional,
            expert_parallel=expert_parallel, optimizer_update=optimizer_update)

        if len(opts) == 2:  # Muon and AdamW
            @compile_step
            def train_two(model, muon, adamw, x, y):
                loss = loss_of(spec, model, x, y)
                loss.backward()
                muon.step()
                adamw.step()
                muon.zero_grad()
                adamw.zero_grad()
                return loss

            return Trainer(lambda x, y: train_two(model, *opts, x, y), zero_fx_step=train_two)

        @compile_step
        def train_step(model, opt, x, y):
            loss = loss_of(spec, model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        (opt,) = opts
        return Trainer(lambda x, y: train_step(model, opt, x, y), zero_fx_step=train_step)
    return make


def _training_step(forward: nn.Module, spec: BenchModel, opts: list, setting: Setting) -> Callable:
    """Forward (under autocast with ``--bf16``), backward, the optimizers' steps: the loop
    every peer but zero_fx and DeepSpeed runs, eagerly or compiled whole."""
    def step(x, y):
        with _autocast(setting):
            loss = loss_of(spec, forward, x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        return loss.detach()
    return step


def ddp(compiled: bool):
    def make(model: nn.Module, spec: BenchModel, setting: Setting) -> Trainer:
        from torch.nn.parallel import DistributedDataParallel

        ids = [setting.device] if setting.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids)
        forward = torch.compile(wrapped, backend=setting.backend) if compiled else wrapped
        return Trainer(_training_step(forward, spec, _optimizers(model, spec, setting), setting))
    return make


def _checkpoint_blocks(model: nn.Module, spec: BenchModel) -> None:
    """Full activation checkpointing: each block keeps only its input for the backward."""
    from torch.distributed._composable import checkpoint

    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a recomputed HF layer would append to the KV cache again
    for block in spec.blocks(model):
        checkpoint(block)


def fsdp2(compiled: bool, checkpointed: bool = False):
    def make(model: nn.Module, spec: BenchModel, setting: Setting) -> Trainer:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if checkpointed:
            _checkpoint_blocks(model, spec)
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if setting.bf16 else MixedPrecisionPolicy())
        for block in spec.blocks(model):
            if compiled:
                block.compile(backend=setting.backend)
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return Trainer(_training_step(model, spec, _optimizers(model, spec, setting), setting))
    return make


def deepspeed(stage: int, checkpointed: bool = False):
    def make(model: nn.Module, spec: BenchModel, setting: Setting) -> Trainer:
        import deepspeed as ds

        if checkpointed:
            _checkpoint_blocks(model, spec)
        from zero_fx.config import DEFAULT_BUCKET_BYTES, DEFAULT_PERSISTENCE_THRESHOLD
        from zero_fx.plan.layout import RESIDENT_BUCKET_BYTES

        default = DEFAULT_BUCKET_BYTES[stage]  # zero_fx-3 buckets by block: DeepSpeed by bytes
        bucket = (setting.bucket_bytes or (default if isinstance(default, int)
                                           else RESIDENT_BUCKET_BYTES)) // 4  # fp32 elements
        zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
        if stage == 3:
            # Its defaults keep up to 1e9 gathered elements alive for reuse in the
            # backward: a small model is never released. Here it releases as zero_fx
            # does: a bucket in use and one prefetched.
            zero.update(stage3_prefetch_bucket_size=bucket,
                        stage3_param_persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD,
                        stage3_max_live_parameters=2 * bucket, stage3_max_reuse_distance=bucket)
        if stage == 3 and setting.optimizer == "muon":
            zero["reduce_scatter"] = False  # its stage 3 refuses Muon with its reduce-scatter
        config = {
            "train_micro_batch_size_per_gpu": spec.batch_per_rank,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": setting.bf16},
            "fp16": {"enabled": False},
            "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9,
            **deepspeed_optimizer(setting.optimizer),
        }
        own = {} if "optimizer" in config else {"optimizer": _optimizers(model, spec, setting)[0]}
        engine, _, _, _ = ds.initialize(model=model, config=config, **own)

        def step(x, y):
            loss = loss_of(spec, engine, x, y)
            engine.backward(loss)
            engine.step()
            return loss.detach()
        return Trainer(step)
    return make


def plain_compile(model: nn.Module, spec: BenchModel, setting: Setting) -> Trainer:
    torch._dynamo.config.trace_autograd_ops = True  # capture loss.backward() in the graph
    step = _training_step(model, spec, _optimizers(model, spec, setting), setting)
    return Trainer(torch.compile(step, backend=setting.backend), whole_batch=True)


PEERS = {
    **{f"zero_fx-{s}": zero_fx(s) for s in range(4)},
    "zero_fx-3-whole": zero_fx(3, regional=False),
    "zero_fx-3-update-after": zero_fx(3, optimizer_update="eager"),
    "zero_fx-3-blocks": zero_fx(3, recompute="blocks"),
    "zero_fx-3-cudagraphs": zero_fx(3, cuda_graphs=True),
    "zero_fx-3-auto": zero_fx(3, recompute="auto"),
    "zero_fx-3-ep2": zero_fx(3, expert_parallel=2),
    "ddp": _spmd_experts(ddp(compiled=False)),
    "ddp-compiled": _spmd_experts(ddp(compiled=True)),
    "fsdp2": _spmd_experts(fsdp2(compiled=False)),
    "fsdp2-compiled": _spmd_experts(fsdp2(compiled=True)),
    "fsdp2-ac": _spmd_experts(fsdp2(compiled=False, checkpointed=True)),
    **{f"deepspeed-{s}": _spmd_experts(deepspeed(s)) for s in (1, 2, 3)},
    "deepspeed-3-ac": _spmd_experts(deepspeed(3, checkpointed=True)),
    "torch.compile": _spmd_experts(plain_compile),
}
"""Every peer by its command-line name, in the table's order."""

REFERENCE = "fsdp2"
"""The table's ratios are against this peer."""

MOE_ONLY_PEERS = {"zero_fx-3-ep2"}
"""Peers for a mixture-of-experts model only (run by default with hf-mixtral)."""

OPTIONAL_PEERS = {"deepspeed": "deepspeed"}
"""Peers whose package is an optional extra: name prefix -> module to import."""
