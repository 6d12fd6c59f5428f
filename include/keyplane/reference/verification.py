"""Exactness checks: what a job counted against what the workload generated.

Every fault and migration test ends with the same question — was each event
counted exactly once? The generator is deterministic, so the ground truth is
recomputed from the spec instead of being trusted from the job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from keyplane.algorithms.partials import sum_by
from keyplane.reference.events import key_name
from keyplane.reference.pipeline import FIRST_STAGE, SECOND_STAGE
from keyplane.reference.workloads import WorkloadSpec


def expected_counts(spec: WorkloadSpec, n_events: int | None = None) -> pd.DataFrame:
    """Ground truth ``stage, key, count`` of the first ``n_events`` of ``spec``."""
    limit = spec.n_events if n_events is None else n_events
    a_parts, b_parts = [], []
    for batch in spec.batches(200_000):
        if batch.start >= limit:
            break
        take = min(len(batch), limit - batch.start)
        a_parts.append(batch.a[:take])
        b_parts.append(batch.b[:take])
    frames = []
    for stage, parts in ((FIRST_STAGE, a_parts), (SECOND_STAGE, b_parts)):
        keys, counts = np.unique(
            np.concatenate(parts) if parts else np.array([], np.int64), return_counts=True
        )
        frames.append(
            pd.DataFrame({"stage": stage, "key": [key_name(int(k)) for k in keys], "count": counts})
        )
    return pd.concat(frames, ignore_index=True)


def expected_counts_of(specs: Iterable[WorkloadSpec]) -> pd.DataFrame:
    """Ground truth ``stage, key, count`` of several workloads sent to one topic.

    A test or a demo often sends a warm-up, then the workload it measures,
    or one workload per phase of a rollout; the job counts them all, so the
    truth is their counts summed per stage and key.
    """
    frames = [expected_counts(spec) for spec in specs]
    if not frames:
        return pd.DataFrame({"stage": [], "key": [], "count": []}).astype({"count": "int64"})
    together = pd.concat(frames, ignore_index=True)
    return sum_by(together, ["stage", "key"], ["count"])


@dataclass(frozen=True)
class CountReport:
    """How observed counts differ from the truth, in events."""

    expected_events: int
    lost: int
    duplicated: int
    wrong_keys: int

    @property
    def exact(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.wrong_keys == 0


def compare_counts(expected: pd.DataFrame, observed: pd.DataFrame) -> CountReport:
    """Compare per-(stage, key) counts. Lost and duplicated are summed over keys."""
    merged = expected.merge(
        observed, on=["stage", "key"], how="outer", suffixes=("_exp", "_obs")
    ).fillna(0)
    diff = merged["count_obs"].astype(np.int64) - merged["count_exp"].astype(np.int64)
    a_rows = merged["stage"] == FIRST_STAGE
    return CountReport(
        expected_events=int(merged.loc[a_rows, "count_exp"].sum()),
        lost=int(-diff[diff < 0].sum()),
        duplicated=int(diff[diff > 0].sum()),
        wrong_keys=int((diff != 0).sum()),
    )


def counts_from_mapping(counts: Mapping[tuple[str, str], int]) -> pd.DataFrame:
    return pd.DataFrame(
        [(stage, key, n) for (stage, key), n in counts.items()], columns=["stage", "key", "count"]
    )
