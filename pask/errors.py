"""The one error type the CLI turns into a clear message (no traceback)."""


class PaskError(Exception):
    """A user-facing error: bad input, missing model part, bad table file, ..."""
