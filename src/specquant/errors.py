"""One error type for bad input: the CLI prints it as one line and exits non-zero."""


class SpecquantError(Exception):
    """A user-facing error: the message names the bad value and the fix."""
