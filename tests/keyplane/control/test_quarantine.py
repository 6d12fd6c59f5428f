"""Poison records: blamed in the stage, retried once, then quarantined; or the job stops."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from keyplane.aggregates import RunningCount
from keyplane.control.quarantine import (
    Poison,
    PoisonRecords,
    PoisonUnresolved,
    Quarantine,
    blame,
    poison_in,
)
from keyplane.testing import POISON_VALUE, RaisesOnPoison


def _raised(values: list[str], aggregate: RunningCount | None = None) -> PoisonRecords:
    aggregate = aggregate or RaisesOnPoison()
    try:
        aggregate.add(0, values)
    except Exception as error:
        return blame(aggregate, "A", "k\x00", 0, values, error)
    raise AssertionError("the aggregate did not raise")


def test_the_values_to_blame_are_found_one_by_one_and_read_back_from_any_text_pure() -> None:
    poison = _raised(["x", POISON_VALUE, "y", POISON_VALUE]).poison
    assert poison == Poison(
        stage="A", key="k\x00", values=(POISON_VALUE,), error="ValueError: cannot count 'poison'"
    )
    assert poison.pairs() == [("k\x00", POISON_VALUE)]
    raised = _raised([POISON_VALUE])
    text = f"Traceback ...\nkeyplane.control.quarantine.PoisonRecords: {raised}\n at ..."
    assert poison_in(text) == poison
    assert poison_in("java.lang.OutOfMemoryError: Java heap space") is None
    assert Poison(stage="B", key="b", values=("a",), error="e").pairs() == [("a", "b")]


def test_a_poison_is_retried_once_then_quarantined_pure(tmp_path: Path) -> None:
    quarantine = Quarantine(tmp_path / "checkpoint")
    error = f"task failed: {_raised([POISON_VALUE])}"
    assert quarantine.option() == "[]"
    assert quarantine.after_failure(error)  # the first failure: start again, nothing held
    assert quarantine.record().pairs == ()
    assert quarantine.after_failure(error)  # the same again: quarantined
    (pair,) = quarantine.record().pairs
    assert (pair.a, pair.b) == ("k\x00", POISON_VALUE)
    assert pair.reason.startswith("poison: stage A's aggregate raised ValueError")
    assert json.loads(quarantine.option()) == [["k\x00", POISON_VALUE, pair.reason]]
    assert not quarantine.after_failure("a broker was down")
    with pytest.raises(PoisonUnresolved, match="although its events are quarantined"):
        quarantine.after_failure(error)


class _RaisesOnTwo(RunningCount):
    """Raises only when a batch holds two values: no single one is to blame."""

    def add(self, state: int, values: Sequence[str]) -> int:
        if len(values) > 1:
            raise ValueError("too many")
        return state + len(values)


def test_no_single_value_to_blame_stops_the_job_naming_partitions_and_offsets_pure(
    tmp_path: Path,
) -> None:
    checkpoint = tmp_path / "checkpoint"
    for name in ("offsets", "commits"):
        (checkpoint / name).mkdir(parents=True)
    for batch, events in ((0, {"0": 5, "1": 7}), (1, {"0": 9, "1": 7})):
        entry = ["v1", "{}", json.dumps({"events": events, "routing": {"A": 1, "B": 1}})]
        (checkpoint / "offsets" / str(batch)).write_text("\n".join(entry) + "\n")
    (checkpoint / "commits" / "0").write_text("v1\n{}\n")
    error = str(_raised(["x", "y"], _RaisesOnTwo()))
    # The first time it may be passing: the job's own restarts decide.
    assert not Quarantine(checkpoint).after_failure(error)
    with pytest.raises(PoisonUnresolved) as stopped:
        Quarantine(checkpoint).after_failure(error)
    message = str(stopped.value)
    assert "on none of its values alone, in batch 1 (events partition 0 offsets 5-9), twice" in (
        message
    )
    assert "\n" not in message


def test_only_the_same_batch_failing_again_is_a_second_failure_pure(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    for name in ("offsets", "commits"):
        (checkpoint / name).mkdir(parents=True)
    error = str(_raised([POISON_VALUE]))
    quarantine = Quarantine(checkpoint)
    (checkpoint / "offsets" / "4").write_text("v1\n{}\n{}\n")
    assert quarantine.after_failure(error)
    (checkpoint / "commits" / "4").write_text("v1\n{}\n")
    (checkpoint / "offsets" / "5").write_text("v1\n{}\n{}\n")
    assert quarantine.after_failure(error)  # batch 5's first failure, not batch 4's second
    assert quarantine.record().pairs == ()
    assert quarantine.after_failure(error)
    assert len(quarantine.record().pairs) == 1
