"""Configuration of a compiled step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

BackendName = str
Compiler = Callable[[torch.fx.GraphModule, list], Callable]

NAMED_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class ZeroConfig:
    """How ``zero_compile`` shards and compiles a training step."""

    stage: int = 3
    """ZeRO stage: 0 = DDP, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters."""
    backend: Union[BackendName, Compiler] = "inductor"
    """Lowers the rewritten graph: "inductor", "aot_eager", "eager" (run the
    rewritten aten graph as is), or a callable ``compiler(gm, example_inputs) -> callable``."""
    disable_passes: Sequence[str] = field(default_factory=tuple)
    """Names of our passes to skip (see ``zero_fx.passes.PASS_ORDER``); for debugging."""
    elementwise_optimizer: Optional[bool] = None
    """Declare that an optimizer zero_fx does not know updates each element
    independently (so it may step on flat shards). ``None``: known torch.optim
    optimizers only."""

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(
                f"stage must be 0, 1, 2 or 3 (0 = DDP, 1 = optimizer states, 2 = + gradients, "
                f"3 = + parameters); got {self.stage!r}"
            )
        if isinstance(self.backend, str) and self.backend not in NAMED_BACKENDS:
            raise ValueError(
                f"backend must be one of {NAMED_BACKENDS} or a callable compiler(gm, example_inputs); "
                f"got {self.backend!r}"
            )
        if not isinstance(self.backend, str) and not callable(self.backend):
            raise TypeError(f"backend must be a name or a callable, got {type(self.backend).__name__}")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))


def describe_backend(backend: Any) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
