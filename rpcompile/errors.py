"""Errors that rpcompile raises: each says what is wrong and how to fix it."""


class RPCompileError(RuntimeError):
    """Base class of rpcompile's errors."""


class CaptureError(RPCompileError):
    """The model could not be captured as one graph (graph break, unsupported op, bad input)."""


class InputError(RPCompileError, TypeError):
    """An argument of a call has a type or shape rpcompile cannot handle."""


class StageError(RPCompileError):
    """A stage job failed on a device; names the stage, the microbatch and the device."""

    def __init__(self, message, *, stage=None, microbatch=None, device=None):
        super().__init__(message)
        self.stage, self.microbatch, self.device = stage, microbatch, device
