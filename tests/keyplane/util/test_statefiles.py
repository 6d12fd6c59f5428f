"""State files read back into their model: no file is nothing, anything else wrong one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel

from keyplane.util.statefiles import read_model_file


class Pid(BaseModel):
    pid: int


class Refused(Exception):
    pass


def _read(path: Path) -> Pid | None:
    return read_model_file(path, Pid, what="a pid file", fix="remove it", error=Refused)


def test_a_missing_file_is_nothing_and_a_good_one_its_model(tmp_path: Path) -> None:
    assert _read(tmp_path / "none.json") is None
    (tmp_path / "pid.json").write_text('{"pid": 7}')
    assert _read(tmp_path / "pid.json") == Pid(pid=7)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.write_text(""), "{p} is not a pid file (file: Invalid JSON: EOF"),
        (lambda p: p.write_text('{"pid": "x"}'), "{p} is not a pid file (pid: Input should be"),
        (lambda p: p.write_bytes(b"\xff"), "cannot read the pid file {p} ('utf-8' codec"),
        (lambda p: p.mkdir(), "cannot read the pid file {p} (Is a directory); remove it"),
    ],
    ids=["empty", "wrong-type", "not-utf-8", "a-directory"],
)
def test_a_file_that_is_not_the_model_is_one_line_naming_it(
    tmp_path: Path, write: Callable[[Path], object], message: str
) -> None:
    path = tmp_path / "pid.json"
    write(path)
    with pytest.raises(Refused) as refused:
        _read(path)
    assert str(refused.value).startswith(message.format(p=path))
    assert str(refused.value).endswith("; remove it") and "\n" not in str(refused.value)
