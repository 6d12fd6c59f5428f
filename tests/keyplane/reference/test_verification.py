from __future__ import annotations

from keyplane.reference.verification import compare_counts, expected_counts, expected_counts_of
from keyplane.reference.workloads import PairsWorkload, ZipfEvolvingWorkload


def test_the_truth_of_several_workloads_sums_their_counts_per_stage_and_key() -> None:
    first = PairsWorkload(n_keys=30, locality=0.8, n_events=2_000, seed=1)
    second = ZipfEvolvingWorkload(n_keys=40, exponent=1.1, n_categories=6, n_events=3_000, seed=2)
    truth = expected_counts_of((first, second))

    assert int(truth["count"].sum()) == 2 * (first.n_events + second.n_events)
    assert not truth.duplicated(["stage", "key"]).any()
    one, two = expected_counts(first), expected_counts(second)
    for stage, key, count in truth.itertuples(index=False):
        alone = [
            frame.loc[(frame["stage"] == stage) & (frame["key"] == key), "count"].sum()
            for frame in (one, two)
        ]
        assert count == sum(alone), (stage, key)
    assert compare_counts(truth, truth).exact


def test_the_truth_of_no_workload_is_empty() -> None:
    truth = expected_counts_of(())
    assert list(truth.columns) == ["stage", "key", "count"] and truth.empty
