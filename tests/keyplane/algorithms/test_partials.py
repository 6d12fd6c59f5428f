"""Merging partials keeps keys apart that pandas' object hashing would merge."""

from __future__ import annotations

import pandas as pd

from keyplane.algorithms.partials import latest_partials, merge_partials
from keyplane.spark.routed_sink import latest_partials_of_batch

KEYS = ["\x00a", "\x00b", "\x01\x00a", "a\x00", "a\x00b", "", "a"]
"""Keys equal up to a NUL, which pandas hashes object strings up to."""


def test_keys_that_differ_after_a_nul_merge_apart_pure() -> None:
    rows = pd.DataFrame(
        [("A", key, f"\x01{key}#{salt}", n, 1) for n, key in enumerate(KEYS, 1) for salt in (0, 1)],
        columns=["stage", "key", "routed_key", "count", "batch"],
    )
    assert len(latest_partials(rows)) == 2 * len(KEYS)
    merged = merge_partials(rows)
    assert dict(zip(merged["key"], merged["count"], strict=True)) == {
        key: 2 * n for n, key in enumerate(KEYS, 1)
    }
    assert merged["key"].dtype == object


def test_a_batch_keeps_one_partial_per_routed_key_nul_or_not_pure() -> None:
    output = pd.DataFrame(
        {
            "kind": ["count"] * len(KEYS) * 2,
            "stage": ["B"] * len(KEYS) * 2,
            "key": KEYS * 2,
            "routed_key": [f"\x01{key}#3" for key in KEYS] * 2,
            "instance": [1] * len(KEYS) * 2,
            "count": [1] * len(KEYS) + [2] * len(KEYS),
            "state": ["1"] * len(KEYS) + ["2"] * len(KEYS),
        }
    )
    latest = latest_partials_of_batch(output)
    assert sorted(latest["key"]) == sorted(KEYS)
    assert latest["count"].tolist() == [2] * len(KEYS)
