"""The JSON records the dashboard reads, typed and checked once, when read.

Other steps write these files (the DAG's tasks, ``prepare_rollback``), but a
file edited by hand, written by an older release or damaged on disk may hold
any JSON. A value of the wrong type must neither fail the page (a string
formatted as a number, an integer escaped as text) nor read as something it
is not: ``"false"`` is truthy and ``true`` is the integer 1. So each record
is validated field by field at the boundary. A field of the wrong type is
dropped and reads as unknown ("—" on the page), and the reader returns a
problem line naming the file and the field; the rest of the record still
shows. A missing field is unknown too, without a problem: older records lack
fields that newer ones carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A JSON number (an integer too), never a string, a boolean, NaN or infinity."""

_SHOWN = 60
"""Characters of a rejected value quoted in its problem line: enough to recognise it."""


class Record(BaseModel):
    """A record some other step wrote: every field optional, null rejected.

    The writers never store null, so a null field is as broken as one of the
    wrong type and is reported the same way.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_no_value(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("null is not a value here")
        return value


class ProposalRecord(Record):
    """``proposal.json``: the version a run stored and the waves rolled out before it."""

    version: StrictInt | None = None
    waves: tuple[StrictInt, ...] = ()


class DecisionRecord(Record):
    """``decision.json``: whether the run published, with the gain, cost and reason."""

    publish: StrictBool | None = None
    gain: FiniteFloat | None = None
    cost: FiniteFloat | None = None
    reason: StrictStr | None = None


class RollbackRecord(Record):
    """``rollback.json``: the rollback version, what it restores and what it replaces."""

    version: StrictInt | None = None
    restores: StrictInt | None = None
    replaces: StrictInt | None = None
    reason: StrictStr | None = None


class ValidationRecord(Record):
    """``validation-v<version>.json``: a version's validation verdict and GX summary."""

    version: StrictInt | None = None
    success: StrictBool | None = None
    summary: StrictStr | None = None


R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class Checked(Generic[R]):
    """One record as read: None when absent or not a JSON object, and what was wrong."""

    record: R | None
    problems: tuple[str, ...] = ()


def read_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object in ``path``, or None with why (no reason when the file is absent)."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as error:
        return None, f"{path}: unreadable: {error}"
    if not isinstance(value, dict):
        return None, f"{path}: unreadable: not a JSON object"
    return value, None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def check(model: type[R], raw: dict[str, Any], source: Path) -> Checked[R]:
    """``raw`` as ``model``, without the fields of the wrong type, each named in a problem."""
    try:
        return Checked(model.model_validate(raw))
    except ValidationError as error:
        rejected: dict[str, str] = {}
        for detail in error.errors():
            field = str(detail["loc"][0])
            rejected.setdefault(field, str(detail["msg"]))
    problems = tuple(
        f"{source}: field {field!r} is unreadable ({_shown(raw.get(field))}: {reason})"
        for field, reason in rejected.items()
    )
    kept = {name: value for name, value in raw.items() if name not in rejected}
    return Checked(model.model_validate(kept), problems)


def read_record(model: type[R], path: Path) -> Checked[R]:
    """The record in ``path`` as ``model``, checked field by field (:func:`check`)."""
    raw, problem = read_json(path)
    if raw is None:
        return Checked(None, () if problem is None else (problem,))
    return check(model, raw, path)
