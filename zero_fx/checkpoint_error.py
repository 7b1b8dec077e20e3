"""The error of files that cannot be loaded, raised by checkpoint/ (zero_fx's checkpoints)
and by materialize/ (HuggingFace weights). A leaf: materialize/ sits below the runtime
whose state checkpoint/ saves (docs/architecture.md, "The layers")."""


class CheckpointError(RuntimeError):
    """The checkpoint cannot be loaded: incomplete, truncated, corrupted, or for another model."""
