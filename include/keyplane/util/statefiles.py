"""The small JSON files keyplane keeps beside what it runs, read back into their model.

The broker's and the job's pid files, the S3 server's state and the
controller's state are written by keyplane, but a crash can truncate one and
a hand can edit or replace it. Every reader answers the same way: no file
means nothing recorded, and anything else wrong, a file that cannot be read,
is not UTF-8 or is not the model, is one line naming the file and what to do,
never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from keyplane.util.validation_errors import first_problem

M = TypeVar("M", bound=BaseModel)


def os_reason(error: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read, in a few words (``Is a directory``)."""
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


def read_model_file(
    path: Path, model: type[M], *, what: str, fix: str, error: type[Exception]
) -> M | None:
    """``path``'s JSON as ``model``; None when there is no file.

    ``what`` names the file with its article (``"a broker pid file"``) and
    ``fix`` says what to do; a file that is there but unreadable or not the
    model raises ``error`` with one line made of both.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        noun = what.split(" ", 1)[1]
        raise error(f"cannot read the {noun} {path} ({os_reason(exc)}); {fix}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise error(f"{path} is not {what} ({first_problem(exc, 'file')}); {fix}") from None
