"""The user's options. By role:

- ``options``: ``ZeroConfig``, every option of ``zero_compile`` checked where it is given,
  and what the plan, the backend and the runtime read of them;
- ``policies``: the options grouped as policies (``SchedulePolicy``, ``OffloadPolicy``,
  ``RecomputePolicy``, ``QuantizationPolicy``, ``MixedPrecision``, ``DebugOptions``);
- ``checks``: the checks that read several options at once (the stage with offload, the
  mesh's dimension names, the quantized formats);
- ``renamed_options``: 0.1's option names, translated at the door with a warning.

The old paths ``zero_fx.policies``, ``zero_fx.checks`` and ``zero_fx.renamed_options`` are
these modules (``zero_fx/__init__.py`` registers them), and ``zero_fx.config`` gives what the
module of that name gave."""

from .options import (DEFAULT_BUCKET_BYTES, DEFAULT_PERSISTENCE_THRESHOLD,
                      DEFAULT_RESIDENT_MAX_NUMEL, BackendName, Compiler, ZeroConfig,
                      describe_backend)
from .checks import GRADIENT_FORMATS, MESH_DIM_NAMES, OFFLOAD_MODES, WEIGHT_FORMATS
from .policies import DUMP_ENV, FLOAT_DTYPES, DebugOptions, MixedPrecision
from .renamed_options import (DEPRECATED_OPTIONS, RENAMED_OPTIONS_KEPT_THROUGH,
                              old_names_in_errors, translate_deprecated)

__all__ = [
    "BackendName", "Compiler", "DEFAULT_BUCKET_BYTES", "DEFAULT_PERSISTENCE_THRESHOLD",
    "DEFAULT_RESIDENT_MAX_NUMEL", "DEPRECATED_OPTIONS", "DUMP_ENV", "DebugOptions",
    "FLOAT_DTYPES", "GRADIENT_FORMATS", "MESH_DIM_NAMES", "MixedPrecision", "OFFLOAD_MODES",
    "RENAMED_OPTIONS_KEPT_THROUGH", "WEIGHT_FORMATS", "ZeroConfig", "describe_backend",
    "old_names_in_errors", "translate_deprecated",
]
