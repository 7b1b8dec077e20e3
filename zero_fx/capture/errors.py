"""The error of a step zero_fx cannot capture (raised by capture, re-exported as
``zero_fx.CaptureError``)."""


class CaptureError(RuntimeError):
    """The training step does not have the shape zero_fx can shard."""
