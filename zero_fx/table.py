"""What the ZeRO table promises per stage: traffic per step and model-state bytes per rank.

The table (``shared/DESIGN.md``, ZeRO paper §5) for Ψ parameters on N ranks,
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
                      master_bytes: int = FP32) -> float:
    """Per-rank bytes of parameters, gradients, master and optimizer state at the peak of a step.

    Stage 3 excludes the gathered working set (the parameters in use and their
    full gradients before they are reduced), which depends on the model.
    """
    p, g, m, o, n = param_bytes, grad_bytes, master_bytes, optimizer_bytes, world_size
    per_stage = {
        0: (p + g + o) * psi,
        1: (p + g) * psi + (m + o) * psi / n,
        2: p * psi + (g + m + o) * psi / n,
        3: (g + m + o) * psi / n,
    }
    try:
        return per_stage[stage]
    except KeyError:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}") from None
