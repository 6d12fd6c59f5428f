"""The one kind of error the commands raise for the user: a line, exit status 2."""

from __future__ import annotations


class CliError(RuntimeError):
    """A user-facing error: printed as one line, exit status 2."""
