"""torch.optim.Muon's Newton-Schulz iterations batched by shape: one chain of batched matmuls
for all the matrices of one shape that a step of Muon updates.

[Note: Newton-Schulz batched by shape]
torch.optim.Muon orthogonalises one matrix at a time (``_single_tensor_muon``): five
iterations of three matmuls each, fifteen small kernels per matrix, which leave a GPU mostly
idle on a model's hidden matrices. The matrices one step of Muon updates here often share a
shape: the same matrix of every block a rank owns (after the graph), Llama's q and o, k and v,
gate and up. So while zero_fx steps Muon (``batched_by_shape``), torch's per-matrix loop is
replaced by ``step_batched``: the updates of each shape and dtype are stacked and iterated
together with ``baddbmm``. Per matrix it is the same arithmetic in the same order and layout:
the momentum's ``lerp``, Nesterov's, the Frobenius norm, the iterations in bf16 (a tall matrix
transposed as a view, as torch's is: iterating a contiguous copy of the transpose rounds some
products differently, so a tall and a wide matrix of one shape once transposed are not
batched together), torch's own learning-rate adjustment for the parameter's shape, the
decoupled weight decay. On a CPU the result is torch's bit for bit (momentum and parameters,
``tests/test_batched_muon.py``, and ``python -m bench.experiments.muon_batching`` on GPT
widths up to 768); on a GPU cuBLAS may pick another kernel for a batch than for one matrix,
which moves results within bf16's rounding.

Where it applies: torch.optim.Muon's functional step, called while ``batched_by_shape`` is
active, with torch's own ``_zeropower_via_newtonschulz`` in place. A step that replaced the
orthogonalisation (fp32 iterations, another polynomial) keeps torch's loop, which calls the
replacement, so what runs is always what the user's Muon would compute. ``explain()`` says
which ran (``kernels_of`` in graph_update.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Optional

import torch
from torch.optim import _muon as muon_module

TORCHS_LOOP = muon_module._single_tensor_muon
TORCHS_ORTHOGONALISATION = muon_module._zeropower_via_newtonschulz


class ShapesBatched:
    """What Muon's batched iterations orthogonalised in the latest optimizer step, for
    ``explain()``: matrices by ``(rows, cols)`` and the batched chains they ran in (one per
    shape in each call of Muon's step: per owner group in the graph)."""

    def __init__(self):
        self.last: Counter = Counter()
        self.last_chains = 0
        self._pending: Counter = Counter()
        self._pending_chains = 0

    def add(self, shape: tuple[int, int], matrices: int) -> None:
        self._pending[shape] += matrices
        self._pending_chains += 1

    def settle(self) -> None:
        """The optimizer step is over: what it batched becomes ``last`` (if it batched any)."""
        if self._pending:
            self.last, self.last_chains = self._pending, self._pending_chains
        self._pending, self._pending_chains = Counter(), 0

    def describe(self) -> str:
        if not self.last:
            return ""
        shapes = ", ".join(f"{n} of {r}x{c}" for (r, c), n in sorted(self.last.items()))
        return (f"Newton-Schulz batched by shape: {sum(self.last.values())} matrices in "
                f"{self.last_chains} batched chains a step on this rank ({shapes})")


def applies() -> bool:
    """Whether torch's Muon runs its own orthogonalisation and loop, which ``step_batched``
    reproduces ([Note: Newton-Schulz batched by shape])."""
    return (muon_module._zeropower_via_newtonschulz is TORCHS_ORTHOGONALISATION
            and muon_module._single_tensor_muon is TORCHS_LOOP)


@contextlib.contextmanager
def batched_by_shape(record: Optional[ShapesBatched] = None):
    """Inside, torch.optim.Muon's steps orthogonalise each shape's matrices together
    (``step_batched``), where that reproduces torch's step (``applies``)."""
    if not applies():
        yield
        return

    def loop(params, grads, bufs, **options):
        step_batched(params, grads, bufs, record=record, **options)

    muon_module._single_tensor_muon = loop
    try:
        yield
    finally:
        muon_module._single_tensor_muon = TORCHS_LOOP


@torch.no_grad()
def step_batched(params: list[torch.Tensor], grads: list[torch.Tensor],
                 bufs: list[torch.Tensor], *, lr, weight_decay: float, momentum: float,
                 nesterov: bool, ns_coefficients: tuple[float, float, float], ns_steps: int,
                 eps: float, adjust_lr_fn: Optional[str], has_complex: bool,
                 record: Optional[ShapesBatched] = None) -> None:
    """torch's ``_single_tensor_muon`` with the iterations of each shape's matrices run as one
    batch: same arguments, same effect on ``params`` and ``bufs``."""
    lr = muon_module._to_scalar(lr)
    if has_complex:
        raise ValueError("Complex parameters are not supported")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    updates = []
    for grad, buf in zip(grads, bufs):
        if grad.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        buf.lerp_(grad, 1 - momentum)
        updates.append(grad.lerp(buf, momentum) if nesterov else buf)
    by_shape: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        by_shape.setdefault((*update.shape, update.dtype, update.device), []).append(i)
    for (rows, cols, _, _), members in by_shape.items():
        tall = rows > cols
        # a tall matrix iterates transposed, as a view of its stack, as torch's does: a
        # contiguous copy of the transpose rounds some products differently
        stack = torch.stack([updates[i].bfloat16() for i in members])
        orthogonal = _orthogonalised(stack.mT if tall else stack, ns_coefficients, ns_steps, eps)
        if record is not None:
            record.add((rows, cols), len(members))
        for i, result in zip(members, orthogonal.unbind(0)):
            param = params[i]
            adjusted_lr = muon_module._adjust_lr(lr, adjust_lr_fn, param.shape)
            param.mul_(1 - lr * weight_decay)
            param.add_(result.mT if tall else result, alpha=-adjusted_lr)


def _orthogonalised(stack: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                    eps: float) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` on each matrix of the ``(B, rows, cols)`` bf16
    ``stack`` (rows <= cols: a tall stack's transposed view), with batched matmuls."""
    a, b, c = coefficients
    x = stack.div_(torch.linalg.vector_norm(stack, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x
