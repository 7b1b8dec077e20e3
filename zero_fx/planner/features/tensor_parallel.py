"""Tensor parallelism planned and priced: ``python -m zero_fx.plan --tp T``.

[Note: planning tensor parallelism]
``--tp T`` plans Megatron-LM's tensor parallelism over T consecutive ranks with ZeRO over
the other dimension of a (dp, tp) mesh, D = W/T ranks at stride T ([Note: ZeRO over
tensor parallelism] in zero_fx/plan/tensor_parallel.py), and sets it beside data
parallelism alone (T = 1) on the same W ranks. Which parameters are split
(``tensor_parallel_split``): every matrix of a repeated block (attention's q, k, v by
heads and its output by rows, the MLP's first matrices by columns and its last by rows)
and, as Megatron does, the vocabulary-parallel embedding and head (a matrix with a
vocabulary-sized side); norms, biases and a learned position table stay whole on every
tensor-parallel rank. Each split parameter counts ceil(numel/T) elements a rank (Megatron
pads a vocabulary T does not divide; a column-parallel bias, split in Megatron, is
counted whole: a few MB). A rank's piece, Ψ_T, is then ZeRO-sharded over D ranks like any
model of Ψ_T parameters: the model-state and traffic tables are ``model_state_breakdown``
and ``TRAFFIC_IN_PSI`` of Ψ_T over D. Stage 3 keeps 16Ψ/W whatever T (Ψ/T over W/T
ranks); stages 0-2, which keep whole parameters, hold 1/T of them.

The working set is not traced under tensor parallelism: the step traced at T = 1 (its
memory timeline, as above) is priced again, as for expert parallelism. A tensor holding
a bucket's whole parameters or gradients (gathered, or about to be reduced) counts 1 - s +
s/T of its bytes, s the split parameters' share of its elements; a shard (a reduced
gradient, Ψ/W) is the same size either way, a piece's Ψ/T over W/T ranks. An activation
counts 1/T where Megatron splits it. Walking the graph in order, a product (mm, addmm,
bmm) of a parameter with a whole activation is column-parallel and its output split; of
a parameter with a split activation, row-parallel and its output whole again (after the
all-reduce); every other op's output is split where one of its inputs is (attention,
SwiGLU, GELU, the logits of the vocabulary-parallel head and their softmax; in the
backward the same rule follows the gradients, and a weight's gradient from a split
activation is split). The residual stream, the norms and their outputs stay whole, on
every rank; with ``--sequence-parallel`` they are split over the sequence too, so every
activation counts 1/T. What is approximated: the transient all-gathered input of a
column-parallel product under sequence parallelism (one b·s·h buffer at a time) and the
vocabulary-parallel cross-entropy's own buffers are left out, and the peak is taken again
on the T = 1 order of nodes. Checked where it runs: the step zero_compile builds for the
tests' GPT split by PyTorch's ColwiseParallel and RowwiseParallel on a (shard 2, tp 2)
mesh peaks within 0.5 % of this price (1 to 4 blocks of width 128 and 256). Sequence
parallelism is priced as Megatron runs it, gathering a product's input again for the
backward; PyTorch's SequenceParallel keeps the gathered input of each column-parallel
product (q, k, v and the MLP's first each gather their own), and that compiled step
peaked 1.30x and 1.37x this price (2 and 4 blocks of width 256).

The seeds' question is whether one layer fits: the largest block's gathered parameters,
its gradients before they are reduced (both in the compute dtype, 1/T of its matrices)
and the activations it keeps for the backward (what one more block adds to the tensors
the traced forward leaves to the backward, priced again for T), beside the estimated peak
of the whole step. Checked against Megatron's count (Korthikanti et al. 2022: a GPT
block keeps 34·sbh bytes in 16-bit with flash attention, 2·sbh of them dropout masks, and
10·sbh of them stay whole under tensor parallelism): gpt-64k (no dropout) at 2048 tokens
in fp16 keeps 32.0·sbh a block at T = 1, 11.0·sbh at T = 8 (8 + 24/8) and 4.0·sbh with
sequence parallelism (32/8). The step time is the cost model's compute divided by T (the
norms' share is not split without sequence parallelism: an approximation), beside which
ZeRO's collectives run on the data-parallel group, plus tensor parallelism's own, which
nothing hides ([Note: pricing tensor parallelism] in zero_fx/analysis/cost_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Optional

import torch
from torch.fx import GraphModule

from ...analysis.transfer_seconds import (TP_COLLECTIVES_PER_BLOCK, data_parallel_ranks,
                                         ring_seconds, tensor_parallel_seconds)
from ...analysis.hardware import hardware
from ...analysis.memory_timeline import memory_timeline, peak_alive
from ...passes.common.predicates import carried_params, is_param_input, is_view, param_name
from ...plan.layout import ShardPlan, block_of, in_block
from ..report import ExpertBlocks, PlanReport, TensorParallelRow, TensorParallelShape, peak_of
from ..stages import rank_pieces, stage_plan


@dataclass(frozen=True)
class TensorParallelOptions:
    """What ``--tp`` plans ([Note: planning tensor parallelism]): Megatron's tensor
    parallelism over ``degree`` ranks (1: none), with ``sequence_parallel`` the norms'
    activations split too."""

    degree: int = 1
    sequence_parallel: bool = False


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def tensor_parallel_shape(model: torch.nn.Module) -> Optional[TensorParallelShape]:
    """Heads, key/value heads, width, feed-forward width and vocabulary of a HuggingFace
    model (its ``config``) or of zero_fx's torch GPT or Llama (its ``cfg``); None for any
    other model."""
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "num_attention_heads"):
        heads, hidden = hf.num_attention_heads, hf.hidden_size
        ffn = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * hidden
        return TensorParallelShape(heads, getattr(hf, "num_key_value_heads", None) or heads,
                                   hidden, ffn, hf.vocab_size)
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "n_embd"):  # GPTConfig
        return TensorParallelShape(cfg.n_head, cfg.n_head, cfg.n_embd, 4 * cfg.n_embd,
                                   cfg.vocab_size)
    if hasattr(cfg, "ffn_dim"):  # LlamaConfig
        return TensorParallelShape(cfg.n_head, cfg.n_kv_head, cfg.dim, cfg.ffn_dim,
                                   cfg.vocab_size)
    return None


def check_tensor_parallel(degree: int, world_size: int, shape: Optional[TensorParallelShape],
                          experts: Optional[ExpertBlocks]) -> None:
    """A ValueError that says what to change where ``degree`` cannot split the model."""
    if experts is not None:
        raise ValueError("tensor parallelism is planned for dense models: split a mixture of "
                         "experts with --expert-parallel instead of --tp")
    if shape is None:
        raise ValueError("tensor parallelism reads the heads, width and feed-forward width "
                         "from a named model or a HuggingFace config.json; this model has "
                         "neither (give --model a name or a config)")
    sizes = (("attention heads", shape.heads), ("key/value heads", shape.kv_heads),
             ("width", shape.hidden), ("feed-forward width", shape.ffn))
    for what, size in sizes:
        if size % degree:
            common = math.gcd(world_size, *(n for _, n in sizes))
            raise ValueError(f"--tp {degree} does not divide the model's {size} {what} "
                             f"(Megatron splits heads, width and feed-forward width evenly): "
                             f"use --tp {divisors(common)}")


def tensor_parallel_split(model: torch.nn.Module, vocab: int) -> frozenset:
    """Names of the parameters tensor parallelism splits: every matrix of a repeated block,
    and a matrix with a side of ``vocab`` (the vocabulary-parallel embedding and head);
    norms, biases, position tables stay whole ([Note: planning tensor parallelism])."""
    return frozenset(name for name, p in model.named_parameters()
                     if p.ndim == 2 and (in_block(name) or vocab in p.shape))


def largest_block(plan: ShardPlan, tp: int, split: frozenset) -> tuple[str, int]:
    """The repeated block of the most elements a rank holds, and their count."""
    blocks: dict[str, int] = {}
    for name, numel in rank_pieces(plan, tp, split).items():
        if in_block(name):
            blocks[block_of(name)] = blocks.get(block_of(name), 0) + numel
    if not blocks:
        return "", 0
    name = max(blocks, key=blocks.get)
    return name, blocks[name]


def tensor_parallel_collectives(plan: ShardPlan, recompute: Optional[str]) -> int:
    """Tensor parallelism's collectives of b·s·h per step ([Note: pricing tensor
    parallelism]): 4 a block, 6 with the recompute of blocks (the forward again), and 2 for
    the vocabulary-parallel embedding and head."""
    blocks = len({block_of(layout.name) for layout in plan.params if in_block(layout.name)})
    return (TP_COLLECTIVES_PER_BLOCK + (2 if recompute == "blocks" else 0)) * blocks + 2


def tensor_parallel_row(report: PlanReport, plan: ShardPlan, degree: int, split: frozenset,
                        shape: TensorParallelShape, collectives: int, traced: Optional[dict],
                        per_block: Optional[dict]) -> TensorParallelRow:
    """Degree ``degree``'s states, largest block, working set, bytes and time per rank
    ([Note: planning tensor parallelism]); ``plan`` shards over the data-parallel ranks,
    in mixed precision where the report's dtype is under 4 bytes."""
    hw, item, key = hardware(report.hardware), report.dtype.itemsize, "tp" if degree > 1 else 1
    mixed = item < 4
    stage = stage_plan(report.stage, plan, item, mixed, report.optimizer, degree, split)
    pieces = rank_pieces(plan, degree, split)
    matrix = max((pieces[layout.name] for layout in plan.params
                  if len(layout.shape) == 2 and in_block(layout.name)), default=0)
    working = None if traced is None else traced[key]
    ranks = data_parallel_ranks(report.world_size, degree)
    activation = report.tokens_per_rank * shape.hidden * item  # b·s·h
    return TensorParallelRow(
        degree=degree, params_per_rank=sum(pieces.values()), state_bytes=stage.state_bytes,
        block_params=largest_block(plan, degree, split)[1] * item,
        block_activations=None if per_block is None else per_block[("kept", key)],
        largest_matrix=matrix * item, working_set=working,
        peak_bytes=None if working is None else peak_of(stage.states, working),
        tp_bytes=collectives * activation if degree > 1 else 0.0,
        tp_seconds=collectives * tensor_parallel_seconds(activation, degree, hw) if activation
        else 0.0,
        zero_bytes=sum(stage.traffic.values()),
        zero_seconds=sum(ring_seconds(size, ranks, hw) * (2 if kind == "all_reduce" else 1)
                         for kind, size in stage.traffic.items()),
        compute_seconds=None if traced is None else traced["compute"] / degree)


_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)


def _tensor_parallel_shares(gm: GraphModule, plan: ShardPlan, split: frozenset,
                            sequence_parallel: bool) -> tuple[dict[str, float], set[str]]:
    """Node name -> the share of its bytes that tensor parallelism splits ([Note: planning
    tensor parallelism]): a parameter tensor's split elements; an activation's 1 where
    Megatron splits it (or everywhere, with ``sequence_parallel``), else 0. Then the names
    of the nodes that hold parameters or their gradients' buckets."""
    def of_bucket(node, names) -> float:
        sizes = [(plan.layout(n).padded_numel, n in split) for n in names]
        whole = sum(s for s, _ in sizes)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() < whole:
            return 0.0  # a shard: Ψ/W of the bucket, a piece's Ψ/T over W/T ranks alike
        return sum(s for s, is_split in sizes if is_split) / max(1, whole)

    params: dict = {}  # node -> split share, for nodes that are parameters (or views of them)
    cut: dict = {}  # node -> whether Megatron splits the activation
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if carried_params(node):
            params[node] = of_bucket(node, carried_params(node))
        elif is_param_input(node):
            params[node] = float(param_name(node) in split)
        elif inputs and inputs[0] in params and (
                is_view(node) or node.target is torch.ops.aten._to_copy.default):
            params[node] = params[inputs[0]]
        else:
            acts = [n for n in inputs if n not in params]
            if node.target in _PRODUCTS and acts and len(acts) < len(inputs):
                # parameter x whole activation: column-parallel, its output split;
                # parameter x split activation: row-parallel, its output whole (all-reduced)
                cut[node] = not cut.get(acts[0], False)
            elif node.target is torch.ops.aten.embedding_dense_backward.default:
                cut[node] = True  # the vocabulary-parallel embedding's gradient
            else:
                cut[node] = any(cut.get(n, False) for n in acts)
    shares = {node.name: float(sequence_parallel or is_cut) for node, is_cut in cut.items()}
    shares.update({node.name: share for node, share in params.items()})
    return shares, {node.name for node in params}


def tensor_parallel_prices(gm: GraphModule, plan: ShardPlan, split: frozenset, degree: int,
                           sequence_parallel: bool) -> dict:
    """The working set of ``gm`` (traced without tensor parallelism) priced again for
    ``degree``, ``"tp"``, and the activations the forward keeps for the backward at 1 and
    at ``degree``, ``("kept", 1)`` and ``("kept", "tp")`` ([Note: planning tensor
    parallelism])."""
    timeline = memory_timeline(gm)
    shares, params = _tensor_parallel_shares(gm, plan, split, sequence_parallel)

    def priced(t) -> float:
        return t.bytes * (1 - shares.get(t.node, 0.0) * (1 - 1 / degree))

    kept = [t for t in timeline.tensors if t.node not in params and t.phase == "forward"
            and t.last_use < len(timeline.phases) and timeline.phases[t.last_use] == "backward"]
    return {"tp": peak_alive(len(timeline.transient),
                        ((t.index, t.last_use, priced(t)) for t in timeline.tensors)),
            ("kept", 1): float(sum(t.bytes for t in kept)),
            ("kept", "tp"): sum(priced(t) for t in kept)}
