"""``CaptureError``'s old home: the class is ``zero_fx.errors.CaptureError``."""

from ..errors import CaptureError

__all__ = ["CaptureError"]
