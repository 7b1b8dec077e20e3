"""Which ranks hold which experts, and over which group each expert weight is sharded.

[Note: expert parallelism]
``zero_compile(stage=3, expert_parallel=P)`` splits each mixture-of-experts block's ``E``
routed experts over ``P`` ranks. The ``W`` ranks form ``W / P`` expert-parallel groups of
``P`` consecutive ranks (rank ``g`` is in group ``g // P`` at place ``g % P``, so that a
group sits on one node's fast links), and place ``i`` of every group holds experts ``i *
E / P`` to ``(i + 1) * E / P - 1`` of every block. The ``D = W / P`` ranks at the same
place (``i``, ``i + P``, ...) hold the same experts: their expert-data-parallel group.

- Expert weights are ZeRO-sharded over the expert-data-parallel group (``D`` ranks):
  gathered there before the block runs, and their gradients reduce-scattered there. A
  rank holds ``1 / D`` of each of its ``E / P`` experts, so ``E / (P * D) = E / W`` of a
  block's experts' elements, the same as without expert parallelism; what changes is
  that it gathers ``E / P`` experts instead of ``E`` (memory and bytes), and that its
  tokens travel ([Note: exchanging rows in fixed shapes] in
  zero_fx/capture/experts/expert_exchange.py).
- Everything else (attention, norms, routers, shared experts, embeddings) is sharded
  over all ``W`` ranks, as without expert parallelism.
- Every gradient is the mean over all ``W`` ranks' batches. An expert's gradient on a
  rank already sums the rows of the ``P`` ranks of its expert-parallel group that chose
  it; the reduce-scatter over the ``D`` ranks holding it adds the other groups', so it is
  divided by ``W``, not ``D`` (DeepSpeed divides expert gradients the same way).

Stages 1 and 2 split the experts the same way, each rank keeping its own whole
([Note: expert parallelism at stages 1 and 2] in zero_fx/runtime/sharded_state.py); stage 0
keeps every parameter and its optimizer state whole on every rank, so it has none. On a
hybrid mesh ``("replicate", "shard")`` the groups are made inside each replica's shard
group, so an expert's replicas sit at the same place and its gradient, reduced over its
expert-data-parallel group, is then summed across the replicas like every other shard's.

[Note: experts held as 3-D parameters, split by rows]
transformers 5 holds a block's experts as two 3-D parameters (``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I)), not one module per expert, so no parameter is one expert's. Expert
parallelism then splits each such parameter by its first dimension: place ``i`` keeps rows
``i * E / P`` to ``(i + 1) * E / P - 1`` as the parameter itself (``ExpertParallel.rows``
names them). The plan lays them out at that shape from the start; the model keeps them whole
until it has its values (a meta model is built whole, as its construction would, and
``plan_shard`` cuts a stage-3 shard from the place's rows), and then each parameter's data
is replaced by its rows (``keep_place_rows`` in zero_fx/runtime/distributed/expert_groups.py). From there
on it is a parameter like any other of shape ``(E / P, ...)``, held by every rank: planned, sharded over the expert-data-parallel group, gathered and reduced
there, its gradient divided as an expert's, in stages 1-3. Only what needs the whole
parameter knows the difference: ``full_state_dict()`` and ``full_parameters()`` put the
``P`` places' rows back together, and a checkpoint saves the whole parameter's flat
elements, each rank its range (place ``i``'s rows start at ``i`` times the rows' elements:
[Note: checkpoints under expert parallelism] in zero_fx/checkpoint/contents.py), so that
it loads at any degree and in one process. ``load_pretrained`` would read whole
parameters and is refused for them, saying what to do. DeepSpeed and torchtitan also keep a rank's experts
as the parameter itself (local experts; a DTensor sharded on the experts' dimension).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in expert parallelism (the note)."""

    degree: int
    """P: ranks a block's experts are split over (an expert-parallel group)."""
    rank: int
    """This rank's place in its expert-parallel group: the slice of experts it holds."""
    group_name: str
    """The expert-parallel group: the ranks this one exchanges tokens with."""
    data_size: int
    """D = W / P: ranks that hold the same experts (an expert-data-parallel group)."""
    data_rank: int
    """This rank's place in its expert-data-parallel group."""
    data_group_name: str
    """The expert-data-parallel group: expert weights are sharded and reduced over it."""
    capacity_factor: Optional[float] = None
    """Rows each expert takes, as a multiple of an even spread's ([Note: expert capacity] in
    zero_fx/capture/experts/expert_exchange.py); None: every row."""
    slices: Mapping[str, int] = field(default_factory=dict)
    """Each routed expert's parameter name -> the slice (expert-parallel place) that holds it."""
    rows: frozenset = frozenset()
    """Parameters holding every expert of a block as rows (3-D), of which this rank keeps its
    place's rows ([Note: experts held as 3-D parameters, split by rows])."""

    def holds(self, name: str) -> bool:
        """Whether this rank holds (a shard of) parameter ``name``."""
        return self.slices.get(name, self.rank) == self.rank

    def splits(self, name: str) -> bool:
        """Whether parameter ``name`` is split by expert parallelism (an expert's, or rows of
        every expert's): sharded and reduced over the expert-data-parallel group."""
        return name in self.slices or name in self.rows


def expert_slices(experts_modules: Mapping[str, int], parameter_names, degree: int
                  ) -> dict[str, int]:
    """``{parameter name: slice}`` for every parameter of the routed experts:
    ``experts_modules`` maps each block's experts list (``RoutedExperts.experts``) to its
    number of experts; expert ``i``'s parameters go to slice ``i // (E / degree)``."""
    slices = {}
    for name in parameter_names:
        for prefix, count in experts_modules.items():
            head, _, rest = name.partition(prefix + ".")
            index = rest.partition(".")[0]
            if head == "" and rest and index.isdigit():
                slices[name] = int(index) // (count // degree)
    return slices
