"""Merge the partial counts of split keys into exact per-key counts.

A hot key is split over d routed keys on d instances (FISH, paper 001 §4.1.2),
and each routed key keeps a *partial* running count of the tuples routed to
it; a key in the routing table (paper 000 §3.3) or on the hash fallback has a
single routed key, whose partial is its whole count. A job therefore reports
``stage, key, routed_key, count`` rows, and the merge step is what turns them
back into one exact count per key:

    count(stage, key) = Σ over the key's routed keys of that routed key's latest count.

"Latest" means: the row from the newest batch that reported the routed key,
and within one batch the largest count (a running count only grows inside a
batch, and stage A's partials reach the sink once per downstream group that
saw them). Taking the newest batch rather than the maximum over all batches
is deliberate: once state migration (paper 000 §3.4) moves a key to a new
routed key, the old routed key's final report is what must count, not its
historical maximum.

Pure pandas, no Spark: the same function merges a sink's files, a results
topic, or a test's hand-made rows.
"""

from __future__ import annotations

import pandas as pd

GROUP_COLUMNS = ["stage", "key", "routed_key"]
BATCH_COLUMN = "batch"


def whole_strings(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its text columns as Arrow strings, which pandas hashes whole.

    pandas hashes an object column's strings as C strings, up to their first NUL,
    so grouping or deduplicating on keys that differ only after a NUL (``"\\x00a"``
    and ``"\\x00b"``, or two escaped routed keys, :mod:`keyplane.routing.routedkeys`) put
    them in one group. Arrow strings are hashed with their length. Use it for the
    columns a frame is grouped or deduplicated on.
    """
    text = {name: "string[pyarrow]" for name in frame.columns if frame[name].dtype == object}
    return frame.astype(text) if text else frame


def sum_by(frame: pd.DataFrame, keys: list[str], values: list[str]) -> pd.DataFrame:
    """``frame.groupby(keys, as_index=False)[values].sum()``, its keys compared whole.

    The key columns are grouped as Arrow strings (:func:`whole_strings`) and
    come back with their own dtype, so callers see the frame they expect.
    """
    text = [name for name in keys if frame[name].dtype == object]
    whole = frame.astype(dict.fromkeys(text, "string[pyarrow]")) if text else frame
    summed = whole.groupby(keys, as_index=False, sort=True)[values].sum()
    return summed.astype(dict.fromkeys(text, object)) if text else summed


def last_of_each(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``frame.drop_duplicates(columns, keep="last")``, its keys compared whole
    (:func:`whole_strings`)."""
    return frame[~whole_strings(frame[columns]).duplicated(keep="last").to_numpy()]


def latest_partials(updates: pd.DataFrame) -> pd.DataFrame:
    """One row per ``(stage, key, routed_key)``: its latest reported partial count.

    ``updates`` has columns ``stage, key, count`` and optionally ``routed_key``
    (absent: every key is its own routed key, the unrouted job's output),
    ``batch`` (absent: all rows come from one batch) and any other columns,
    such as ``instance``, which are kept from the chosen row.
    """
    frame = updates.copy()
    if "routed_key" not in frame.columns:
        frame["routed_key"] = frame["key"]
    if BATCH_COLUMN not in frame.columns:
        frame[BATCH_COLUMN] = 0
    ordered = frame.sort_values([BATCH_COLUMN, "count"], kind="mergesort")
    latest = last_of_each(ordered, GROUP_COLUMNS)
    return latest.sort_values(GROUP_COLUMNS, kind="mergesort").reset_index(drop=True)


def merge_partials(updates: pd.DataFrame) -> pd.DataFrame:
    """Exact ``stage, key, count``: the sum of each key's latest partial counts."""
    latest = latest_partials(updates)
    keyed = whole_strings(latest[["stage", "key"]]).assign(count=latest["count"].to_numpy())
    merged: pd.DataFrame = keyed.groupby(["stage", "key"], as_index=False, sort=True).agg(
        count=("count", "sum")
    )
    merged = merged.astype({"stage": object, "key": object})
    merged["count"] = merged["count"].astype("int64")
    return merged
