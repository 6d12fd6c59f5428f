"""Pydantic validation errors, told to an operator in one line.

A file or flag that fails validation is a user's mistake, not a bug: the CLI,
the controller and the job supervisor answer it with one line that names the
field (``operators.A.parallelism: Input should be greater than 0``) rather
than pydantic's multi-line report, so the message fits a terminal, an
Airflow task log or a status field.
"""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails


def describe_error(error: ErrorDetails, whole: str | None = None) -> str:
    """``error`` as ``field.path: message``.

    An error about the whole object has no field path: it is named ``whole``,
    or, when ``whole`` is None, told by its message alone.
    """
    where = ".".join(str(part) for part in error["loc"]) or whole
    return f"{where}: {error['msg']}" if where else error["msg"]


def first_problem(exc: ValidationError, whole: str | None = None) -> str:
    """The first error of ``exc``, as :func:`describe_error` tells it."""
    return describe_error(exc.errors()[0], whole)
