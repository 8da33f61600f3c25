"""The two kinds of failure the command reports as one line instead of a traceback."""


class UsageError(Exception):
    """Bad arguments or a bad data file: one line on stderr, exit code 2."""


class RunError(Exception):
    """A failure of the run the user can act on (no compiler, a failed save): exit code 1."""
