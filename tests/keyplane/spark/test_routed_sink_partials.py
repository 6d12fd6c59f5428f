"""The sink reads the JVM stages' packed install reports as the rows they pack (pure pandas)."""

from __future__ import annotations

import json
import warnings

import pandas as pd

from keyplane.spark.routed_sink import latest_partials_of_batch, unpacked_partials


def test_a_partials_row_reads_as_its_count_rows_pure() -> None:
    reports = [
        ["A", "k", "k#1", None, 0, "0"],  # the tombstone of the routed key that moved out
        ["A", "k", "k#2", 3, 40, "40"],  # the install's partial
        ["B", "m", "m#0", 1, 7, "7"],
    ]
    output = pd.DataFrame(
        [
            {"kind": "count", "stage": "A", "key": "k", "routed_key": "k#2", "instance": 3,
             "count": 45, "state": "45"},  # the key's tuples of the batch, after its install
            {"kind": "partials", "stage": "A", "count": 3, "state": json.dumps(reports)},
            {"kind": "hop", "instance": 0, "n": 5},
        ]
    )  # fmt: skip
    rows = unpacked_partials(output)

    assert "partials" not in set(rows["kind"])
    assert (rows["kind"] == "count").sum() == 4 and (rows["kind"] == "hop").sum() == 1
    latest = latest_partials_of_batch(rows)
    got = latest[["stage", "routed_key", "instance", "count"]].to_dict("records")
    assert sorted(got, key=lambda r: (r["stage"], r["routed_key"])) == [
        {"stage": "A", "routed_key": "k#1", "instance": None, "count": 0},
        {"stage": "A", "routed_key": "k#2", "instance": 3, "count": 45},
        {"stage": "B", "routed_key": "m#0", "instance": 1, "count": 7},
    ]


def test_output_of_packed_rows_only_keeps_its_columns_without_a_warning_pure() -> None:
    """A batch with installs and no events: pandas deprecates concatenating an empty frame."""
    reports = [["A", "k", "k#2", 3, 40, "40"], ["A", "k", "k#1", None, 0, "0"]]
    output = pd.DataFrame(
        [{"kind": "partials", "stage": "A", "key": None, "routed_key": None, "instance": None,
          "count": 2, "state": json.dumps(reports), "target": None}]
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = unpacked_partials(output)

    assert list(rows.columns) == list(output.columns)
    assert rows[["routed_key", "instance", "count"]].to_dict("records") == [
        {"routed_key": "k#2", "instance": 3, "count": 40},
        {"routed_key": "k#1", "instance": None, "count": 0},
    ]
    assert set(rows["kind"]) == {"count"}


def test_output_without_packed_rows_is_returned_as_it_is_pure() -> None:
    output = pd.DataFrame([{"kind": "count", "stage": "A", "key": "k", "count": 1}])
    assert unpacked_partials(output) is output


def test_latest_partials_keep_the_order_of_the_batch_output_pure() -> None:
    """The batch file's rows come in the output's order, which a replay repeats:
    no sort over the text columns; the readers sort as they need."""
    output = pd.DataFrame(
        [
            {"kind": "count", "stage": "B", "key": "z", "routed_key": "z#0", "instance": 2,
             "count": 1, "state": "1"},
            {"kind": "count", "stage": "A", "key": "m", "routed_key": "m#1", "instance": 1,
             "count": 2, "state": "2"},
            {"kind": "count", "stage": "B", "key": "z", "routed_key": "z#0", "instance": 2,
             "count": 3, "state": "3"},  # the same routed key again, later and larger
            {"kind": "count", "stage": "A", "key": "a", "routed_key": "a#0", "instance": 0,
             "count": 4, "state": "4"},
        ]
    )  # fmt: skip
    latest = latest_partials_of_batch(output)
    assert latest["routed_key"].tolist() == ["m#1", "z#0", "a#0"]
    assert latest["count"].tolist() == [2, 3, 4]
