"""The option names of 0.1, renamed since (``DEPRECATED_OPTIONS``): accepted for one release
with a ``FutureWarning`` naming the new option, and spoken of by their old names in errors."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

from .policies import DebugOptions


DEPRECATED_OPTIONS = {
    "memory_budget_bytes": "max_gathered_bytes",
    "persistence_threshold": "resident_max_numel",
    "activation_memory_budget": "activation_budget_fraction (<= 1) or activation_budget_bytes",
    "prefetch": "prefetch_buckets and reduce_overlap_buckets",
    "pin_schedule": "debug=DebugOptions(pin_schedule=...)",
    "disable_passes": "debug=DebugOptions(disable_passes=...)",
    "dump_dir": "debug=DebugOptions(dump_dir=...)",
    "check_ranks": "debug=DebugOptions(check_ranks=...)",
}
"""Options renamed after 0.1 -> what replaces them. Accepted for one release (0.2), with
a ``FutureWarning``."""

_FIELDS_OF_OLD_NAME = {
    "memory_budget_bytes": ("max_gathered_bytes",),
    "persistence_threshold": ("resident_max_numel",),
    "activation_memory_budget": ("activation_budget_fraction", "activation_budget_bytes"),
    "prefetch": ("prefetch_buckets", "reduce_overlap_buckets"),
}


@contextlib.contextmanager
def old_names_in_errors(options: dict):
    """A ``ValueError`` or ``TypeError`` about a field the caller set by its old name (in
    ``options``) speaks of the old name, which is the one the caller wrote."""
    renamed = {new: old for old in options for new in _FIELDS_OF_OLD_NAME.get(old, ())}
    try:
        yield
    except (ValueError, TypeError) as err:
        message = str(err)
        for new, old in renamed.items():
            if message.startswith(f"{new} "):
                raise type(err)(f"{old}{message[len(new):]} ({old!r} is now "
                                f"{DEPRECATED_OPTIONS[old]})") from None
        raise


RENAMED_OPTIONS_KEPT_THROUGH = "0.2"
"""The last release (``zero_fx.__version__`` is 0.1.0) in which a renamed option's old name
still works."""


def warn_renamed(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"zero_fx: the option {old!r} is now {new}; {old!r} still works in "
                  f"{RENAMED_OPTIONS_KEPT_THROUGH} and is removed after it", FutureWarning,
                  stacklevel=stacklevel + 1)


def translate_deprecated(options: dict, *, stacklevel: int = 2) -> dict:
    """``options`` (``ZeroConfig``'s keywords) with the names of 0.1 replaced by theirs,
    each with a ``FutureWarning``. Raises ``ValueError`` when an old name and its new
    name are both given."""
    old = [name for name in options if name in DEPRECATED_OPTIONS]
    if not old:
        return options
    new = {k: v for k, v in options.items() if k not in DEPRECATED_OPTIONS}

    def put(old_name: str, name: str, value) -> None:
        if name in new:
            raise ValueError(f"{old_name} is the old name of {name}: set {name} alone")
        new[name] = value

    debug = {}
    for name in old:
        value = options[name]
        warn_renamed(name, DEPRECATED_OPTIONS[name], stacklevel=stacklevel + 1)
        if name == "memory_budget_bytes":
            put(name, "max_gathered_bytes", value)
        elif name == "persistence_threshold":
            put(name, "resident_max_numel", value)
        elif name == "prefetch":
            put(name, "prefetch_buckets", value)
            put(name, "reduce_overlap_buckets", value)
        elif name == "activation_memory_budget":
            if value is None:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
                put(name, "activation_budget_bytes", int(value))
            else:  # a fraction, or a bad value that activation_budget_fraction rejects
                put(name, "activation_budget_fraction", value)
        else:
            debug[name] = value
    if debug:
        given = new.get("debug")
        if given is not None and not isinstance(given, DebugOptions):
            raise TypeError(f"debug must be a zero_fx.DebugOptions(...), got {type(given).__name__}")
        base = given or DebugOptions()
        both = [name for name in debug if getattr(base, name) != getattr(DebugOptions(), name)]
        if both:
            raise ValueError(f"{both[0]} is set both as a keyword and in debug=DebugOptions(...): "
                             f"set it in debug= alone")
        new["debug"] = dataclasses.replace(base, **debug)
    return new
