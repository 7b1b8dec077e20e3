"""``CheckpointError``'s old home: the class is ``zero_fx.errors.CheckpointError``."""

from .errors import CheckpointError

__all__ = ["CheckpointError"]
