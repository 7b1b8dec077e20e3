"""What the ZeRO table promises per stage: traffic per step and model-state bytes per rank.

The table (``docs/stages.md``, ZeRO paper §5) for Ψ parameters on N ranks,
in full precision (fp32 parameters, gradients and optimizer state; the shard
the optimizer steps on is the fp32 master):

| stage | per-rank model-state bytes      | collectives per step (elements)           |
|-------|---------------------------------|-------------------------------------------|
| 0     | (p + g + o)·Ψ                   | all-reduce Ψ                              |
| 1     | (p + g)·Ψ + (m + o)·Ψ/N         | reduce-scatter Ψ + all-gather Ψ           |
| 2     | p·Ψ + (g + m + o)·Ψ/N           | reduce-scatter Ψ + all-gather Ψ           |
| 3     | (g + m + o)·Ψ/N + working set   | all-gather 2Ψ + reduce-scatter Ψ          |

p, g, m: bytes per element of the compute parameter, gradient and master
(4 each in fp32); o: optimizer state bytes per element (8 for Adam's two
moments, 4 for SGD with momentum). In stage 0 the parameter is its own master.
In stages 1 and 2 the full parameters and (stage 1) full gradients exist
during the step only: between steps a rank holds its shards.

Stage 3's second all-gather re-gathers, for the backward, the parameters the
backward reads. A parameter whose gradient formula never reads its own value
(a bias; an embedding table; the first layer's weight when the input needs no
gradient) is not gathered again, so zero_fx moves at most 2Ψ there.
"""

from __future__ import annotations

from typing import Optional

FP32 = 4

TRAFFIC_IN_PSI = {
    0: {"all_reduce": 1},
    1: {"reduce_scatter": 1, "all_gather": 1},
    2: {"reduce_scatter": 1, "all_gather": 1},
    3: {"reduce_scatter": 1, "all_gather": 2},
}
"""Elements each kind of collective works on per step, as a multiple of Ψ
(upper bound for stage 3's all-gather; see above)."""


def model_state_bytes(stage: int, psi: int, world_size: int, *, optimizer_bytes: int,
                      param_bytes: int = FP32, grad_bytes: int = FP32,
                      master_bytes: int = FP32, reduce_bytes: Optional[int] = None,
                      updates_in_graph: bool = False) -> float:
    """Per-rank bytes of parameters, gradients, master and optimizer state at the peak of a step.

    Stage 3 excludes the gathered working set (the parameters in use and their
    full gradients before they are reduced), which depends on the model.
    """
    return sum(model_state_breakdown(
        stage, psi, world_size, optimizer_bytes=optimizer_bytes, param_bytes=param_bytes,
        grad_bytes=grad_bytes, master_bytes=master_bytes, reduce_bytes=reduce_bytes,
        updates_in_graph=updates_in_graph).values())


def model_state_breakdown(stage: int, psi: int, world_size: int, *, optimizer_bytes: int,
                          param_bytes: int = FP32, grad_bytes: int = FP32,
                          master_bytes: int = FP32, reduce_bytes: Optional[int] = None,
                          updates_in_graph: bool = False) -> dict[str, float]:
    """``model_state_bytes`` by kind: parameters, gradients, masters, optimizer.

    Under mixed precision (``param_bytes`` < ``master_bytes``) the masters are a
    copy of their own, in stage 0 too; ``grad_bytes`` is the gradient the optimizer
    reads (the master's dtype), ``reduce_bytes`` the whole gradient the backward
    produces before it is reduced (default ``grad_bytes``), which stage 1 holds to
    the end of the backward. ``updates_in_graph``: the optimizer steps each bucket as its
    gradients land ([Note: the update in the graph] in zero_fx/runtime/update/graph_update.py), so
    stages 2-3 hold no gradient shards at the peak beyond the buckets in flight (the
    working set's).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    p, g, m, o, n = param_bytes, grad_bytes, master_bytes, optimizer_bytes, world_size
    r = g if reduce_bytes is None else reduce_bytes
    own_master = m if p != m else 0  # fp32 training: the parameter is its own master
    return {
        "parameters": 0 if stage == 3 else p * psi,
        "gradients": (g * psi if stage == 0 else r * psi if stage == 1
                      else 0 if updates_in_graph else g * psi / n),
        "masters": own_master * psi if stage == 0 else m * psi / n,
        "optimizer": o * psi if stage == 0 else o * psi / n,
    }


ZERO_PAPER_K = 12
"""The ZeRO paper's optimizer bytes per parameter: mixed-precision Adam's fp32 master,
momentum and variance (its parameters and gradients are fp16: 2 bytes each)."""


def zero_paper_bytes(stage: int, psi: float, world_size: int, k: int = ZERO_PAPER_K) -> float:
    """The ZeRO paper's per-rank model-state bytes (its Figure 1: 120 GB, 31.4 GB, 16.6 GB and
    1.9 GB for Ψ = 7.5B on 64 ranks with K = 12)."""
    n = world_size
    return {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n,
            2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[stage]
