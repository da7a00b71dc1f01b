"""One error type for bad input: the CLI prints it as one line and exits non-zero."""


class SpecquantError(Exception):
    """A user-facing error: the message names the bad value and the fix."""


def require_positive(config, names: tuple[str, ...], prefix: str = "") -> None:
    """The configs' shared validate() check: each field in `names` is an integer >= 1, else one SpecquantError
    naming the first that is not (prefix: the config's name in the message, e.g. "awq ")."""
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise SpecquantError(f"{prefix}{name}={value} must be a positive integer")

