"""All-gathers on a gloo group take gloo's one-tensor path, not its coalesced one.

[Note: gloo's coalesced all-gather corrupts the heap]
In torch 2.13 the functional ``all_gather_into_tensor`` always runs as a coalesced
all-gather of one tensor (``ProcessGroupGloo::allgather_into_tensor_coalesced``,
then ``allgather_coalesced``). With two or more of them in flight at once, which
is exactly what a prefetching stage-3 schedule does, a rank sooner or later dies
of heap corruption: "malloc(): unaligned tcache chunk detected", SIGSEGV inside
the next collective, or a peer's "Connection reset by peer". Plain PyTorch
reproduces it with no zero_fx code (``python -m bench.experiments.gloo_all_gather_crash``:
two ranks, all-gathers kept two deep, dies within a few thousand gathers), while
the same loop through ``all_gather_into_tensor_out`` (gloo's ``_allgather_base``),
reduce-scatters and all-reduces ran 6,000 iterations clean.

So, on a gloo group, zero_fx registers a CPU kernel for
``_c10d_functional::all_gather_into_tensor`` that allocates the output and calls
the ``_out`` variant. The graph, the traffic and Inductor's generated code are
unchanged (Inductor calls the same op, which now lands here); only the gloo
work behind it differs. The kernel is per process and applies to every CPU
functional all-gather in it, which all get the same result as before.
Remove it once PyTorch's gloo coalesced all-gather is safe with several in flight
(the bench script above says so).
"""

from __future__ import annotations

from typing import Optional

import torch

_library: Optional[torch.library.Library] = None


def use_gloo_single_tensor_all_gather() -> None:
    """Route CPU functional all-gathers through ``all_gather_into_tensor_out`` (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    library.impl("all_gather_into_tensor", _all_gather_into_tensor_cpu, "CPU")
    _library = library


def _all_gather_into_tensor_cpu(shard: torch.Tensor, group_size: int,
                                group_name: str) -> torch.Tensor:
    out = shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))
    return torch.ops._c10d_functional.all_gather_into_tensor_out(shard, group_size, group_name,
                                                                out=out)
