"""Errors that rpcompile raises: each says what is wrong and how to fix it."""


class RPCompileError(RuntimeError):
    """Base class of rpcompile's errors."""


class CaptureError(RPCompileError):
    """The model could not be captured as one graph (graph break, unsupported op, bad input)."""


class InputError(RPCompileError, TypeError):
    """An argument of a call has a type or shape rpcompile cannot handle."""


class StageError(RPCompileError):
    """A stage job failed on a device; names the stage, the microbatch and the device, and
    (`schedule`, raised in the caller's thread) the run's schedule with the failing job marked."""

    def __init__(self, message, *, stage=None, microbatch=None, device=None, job=None, schedule=None, worker=None):
        super().__init__(message if schedule is None else f"{message}\nschedule: {schedule}")
        self.message = message
        self.stage, self.microbatch, self.device, self.job = stage, microbatch, device, job
        self.worker = worker       # the worker index of the device (which copy of a job: Note [replicas])
        self.schedule = schedule

    def with_schedule(self, schedule: str) -> "StageError":
        """This error again, its message followed by the schedule line."""
        err = StageError(self.message, stage=self.stage, microbatch=self.microbatch, device=self.device,
                         job=self.job, schedule=schedule, worker=self.worker)
        err.__cause__ = self.__cause__
        return err


class StepAbandoned(RPCompileError):
    """Internal: a step's job failed while the optimizer waited for its gradients (Note
    [chunk-wise submission]); the runner raises the job's own error."""


# Note [notes on Python 3.10]: rpcompile runs on Python 3.10 (pyproject's requires-python), which
# has no BaseException.add_note (3.11): there a delayed step that failed after its early submission
# raised "AttributeError: 'StageError' object has no attribute 'add_note'" in place of its own error.
_NOTES = hasattr(BaseException, "add_note")


def add_note(exc: BaseException, note: str) -> None:
    """exc.add_note(note) (Python 3.11+). On 3.10 the note is kept in `__notes__` as 3.11 keeps it,
    and, for rpcompile's own errors, goes at the end of the message, since 3.10's traceback prints
    no notes (Note [notes on Python 3.10])."""
    if _NOTES:
        exc.add_note(note)
        return
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
    if isinstance(exc, RPCompileError) and exc.args and isinstance(exc.args[0], str):     # (its message)
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]
