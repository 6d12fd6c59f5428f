from __future__ import annotations

import pytest
from pydantic import BaseModel, Field, ValidationError, model_validator

from keyplane.util.validation_errors import describe_error, first_problem


class _Inner(BaseModel):
    parallelism: int = Field(gt=0)


class _Outer(BaseModel):
    operators: dict[str, _Inner]
    name: str

    @model_validator(mode="after")
    def _named(self) -> _Outer:
        if self.name == "bad":
            raise ValueError("the name is bad")
        return self


def _error(data: object) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        _Outer.model_validate(data)
    return caught.value


def test_a_field_error_names_the_field_path() -> None:
    exc = _error({"operators": {"A": {"parallelism": 0}}, "name": "x"})
    assert first_problem(exc) == "operators.A.parallelism: Input should be greater than 0"
    assert first_problem(exc, "file") == "operators.A.parallelism: Input should be greater than 0"


def test_an_error_about_the_whole_object_names_it_or_gives_the_message_alone() -> None:
    exc = _error({"operators": {}, "name": "bad"})
    assert first_problem(exc, "file") == "file: Value error, the name is bad"
    assert first_problem(exc) == "Value error, the name is bad"


def test_each_error_can_be_told_on_its_own() -> None:
    exc = _error({"operators": {"A": {"parallelism": -1}}})
    told = [describe_error(error, "message") for error in exc.errors()]
    assert told == [
        "operators.A.parallelism: Input should be greater than 0",
        "name: Field required",
    ]
