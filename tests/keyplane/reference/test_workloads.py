"""Tests of the synthetic workload generators (paper 000 §4.2-4.3, paper 001 §6)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from keyplane.reference import workloads
from keyplane.reference.verification import expected_counts
from keyplane.reference.workloads import (
    EventBatch,
    GeoTagsWorkload,
    PairsWorkload,
    WorkloadSpec,
    ZipfEvolvingWorkload,
    parse_workload,
)

SPECS: list[WorkloadSpec] = [
    PairsWorkload(n_events=150_000, n_keys=50, locality=0.6, pad_max=300, seed=3),
    ZipfEvolvingWorkload(n_events=150_000, n_keys=2_000, exponent=1.1, shifts=(0.3, 0.7), seed=3),
    GeoTagsWorkload(
        n_events=150_000, n_regions=20, n_tags=1_000, drift_every=40_000, flash_every=60_000
    ),
]


def whole(spec: WorkloadSpec) -> EventBatch:
    batch = spec.events(0, spec.n_events)
    assert batch.start == 0 and len(batch) == spec.n_events
    return batch


FULL = {spec.kind: whole(spec) for spec in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_same_seed_gives_same_stream_and_other_seed_differs(spec: Any) -> None:
    again = whole(spec.model_copy())
    reference = FULL[spec.kind]
    for field in ("a", "b", "pad"):
        np.testing.assert_array_equal(getattr(again, field), getattr(reference, field))
    other = whole(spec.model_copy(update={"seed": spec.seed + 1}))
    assert np.mean(other.a != reference.a) > 0.3


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
@pytest.mark.parametrize("chunk_size", [1_000, 7_777, 65_536, 100_000, 1_000_000])
def test_chunk_size_does_not_change_the_stream(spec: Any, chunk_size: int) -> None:
    chunks = list(spec.batches(chunk_size))
    assert all(len(c) == chunk_size for c in chunks[:-1])
    assert 0 < len(chunks[-1]) <= chunk_size
    assert [c.start for c in chunks] == [i * chunk_size for i in range(len(chunks))]
    reference = FULL[spec.kind]
    for field in ("a", "b", "pad"):
        joined = np.concatenate([getattr(c, field) for c in chunks])
        np.testing.assert_array_equal(joined, getattr(reference, field))
    assert chunks[0].a.dtype == np.int64 and chunks[0].pad.dtype == np.int32


@settings(max_examples=30, deadline=None)
@given(
    kind_index=st.integers(0, len(SPECS) - 1),
    start=st.integers(0, 150_000),
    length=st.integers(0, 150_000),
)
def test_any_range_regenerates_the_same_slice(kind_index: int, start: int, length: int) -> None:
    spec = SPECS[kind_index]
    stop = min(spec.n_events, start + length)
    part = spec.events(start, stop)
    reference = FULL[spec.kind]
    assert part.start == start and part.stop == stop
    np.testing.assert_array_equal(part.a, reference.a[start:stop])
    np.testing.assert_array_equal(part.b, reference.b[start:stop])
    np.testing.assert_array_equal(part.positions, np.arange(start, stop))


def test_empty_stream_yields_no_batches() -> None:
    assert list(PairsWorkload(n_events=0).batches()) == []


def test_events_outside_the_stream_are_refused() -> None:
    with pytest.raises(ValueError, match="stop <= n_events"):
        PairsWorkload(n_events=10).events(5, 11)


def test_batch_arrays_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="same length"):
        EventBatch(0, np.zeros(3, np.int64), np.zeros(2, np.int64), np.zeros(3, np.int32))


@pytest.mark.parametrize("locality", [0.8, 0.2])
def test_pairs_locality_matches_parameter(locality: float) -> None:
    batch = whole(PairsWorkload(n_events=200_000, n_keys=100, locality=locality, seed=11))
    assert abs(np.mean(batch.a == batch.b) - locality) < 0.01
    assert batch.a.min() == 1 and batch.a.max() == 100
    assert batch.b.min() == 1 and batch.b.max() == 100
    assert np.all(batch.pad == 0)


def test_pairs_non_local_partner_is_uniform() -> None:
    batch = whole(PairsWorkload(n_events=200_000, n_keys=10, locality=0.5, seed=5))
    other = batch.b[batch.a != batch.b]
    counts = np.bincount(other, minlength=11)[1:]
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()


def test_pairs_padding_uniform_within_range() -> None:
    batch = whole(PairsWorkload(n_events=200_000, pad_min=100, pad_max=20_000, seed=2))
    assert batch.pad.min() >= 100 and batch.pad.max() <= 20_000
    assert batch.pad.min() < 300 and batch.pad.max() > 19_800
    assert abs(batch.pad.mean() - 10_050) < 0.01 * 10_050


def test_pairs_constant_padding() -> None:
    batch = whole(PairsWorkload(n_events=1_000, pad_min=512, pad_max=512))
    assert np.all(batch.pad == 512)


def fitted_zipf_exponent(counts: np.ndarray) -> float:
    """Least-squares slope of log frequency against log rank."""
    ranks = np.arange(1, len(counts) + 1)
    slope, _ = np.polyfit(np.log(ranks), np.log(counts), 1)
    return float(-slope)


@pytest.mark.parametrize("exponent", [1.0, 1.5])
def test_zipf_exponent_recovered_on_one_segment(exponent: float) -> None:
    spec = ZipfEvolvingWorkload(
        n_events=1_000_000, n_keys=10_000, exponent=exponent, shifts=(0.8,), seed=7
    )
    batch = spec.events(0, spec.shift_positions()[0])
    counts = np.bincount(batch.a, minlength=spec.n_keys)
    top = spec.hot_keys(0, 100)
    assert abs(fitted_zipf_exponent(counts[top]) - exponent) < 0.05
    empirical_top = np.argsort(counts)[::-1][:3]
    np.testing.assert_array_equal(empirical_top, top[:3])


def test_zipf_field_two_is_the_category_of_field_one() -> None:
    spec = ZipfEvolvingWorkload(n_events=10_000, n_keys=5_000, seed=1)
    batch = whole(spec)
    assert spec.categories == 50
    np.testing.assert_array_equal(batch.b, batch.a % 50)
    assert ZipfEvolvingWorkload(n_keys=50).categories == 1
    assert ZipfEvolvingWorkload(n_keys=5_000, n_categories=7).categories == 7


def test_zipf_shift_makes_hot_keys_cold() -> None:
    spec = ZipfEvolvingWorkload(n_events=200_000, n_keys=1_000, exponent=1.2, shifts=(0.5,), seed=4)
    (shift,) = spec.shift_positions()
    assert shift == 100_000
    assert not set(spec.hot_keys(0, 500)) & set(spec.hot_keys(1, 500))
    batch = whole(spec)
    window = 5_000
    for old, new in [(spec.hot_keys(0, 1)[0], spec.hot_keys(1, 1)[0])]:
        before = batch.a[shift - window : shift]
        after = batch.a[shift : shift + window]
        assert np.sum(before == old) > 0.15 * window and np.sum(after == old) <= 5
        assert np.sum(before == new) <= 5 and np.sum(after == new) > 0.15 * window


def test_zipf_shift_positions_are_exact_including_at_a_block_boundary() -> None:
    # With exponent 40 over two keys, the rank-1 key has probability 1 - 1e-12,
    # so the stream is constant inside each segment and flips exactly at a shift.
    spec = ZipfEvolvingWorkload(
        n_events=200_000, n_keys=2, exponent=40.0, shifts=(0.32768, 0.75), seed=9
    )
    positions = spec.shift_positions()
    assert positions == [65_536, 150_000]
    batch = whole(spec)
    bounds = [0, *positions, spec.n_events]
    for segment in range(3):
        hot = spec.hot_keys(segment, 1)[0]
        assert np.all(batch.a[bounds[segment] : bounds[segment + 1]] == hot)
    assert spec.hot_keys(0, 1)[0] != spec.hot_keys(1, 1)[0]


GEO = GeoTagsWorkload(n_events=900_000, seed=1)
GEO_BATCH = whole(GEO)
WINDOW = GEO.drift_every


def top_tags_per_region(a: np.ndarray, b: np.ndarray, n: int) -> dict[int, set[int]]:
    """The n most frequent tags of each region: an "offline" association table."""
    table: dict[int, set[int]] = {}
    for region in np.unique(a):
        tags, counts = np.unique(b[a == region], return_counts=True)
        table[int(region)] = set(tags[np.argsort(counts)[::-1][:n]].tolist())
    return table


def coverage(table: dict[int, set[int]], a: np.ndarray, b: np.ndarray) -> float:
    """Share of events whose tag is in the table's set for their region."""
    hits = sum(int(tag) in table.get(int(region), set()) for region, tag in zip(a, b, strict=True))
    return hits / len(a)


def test_geo_region_to_tag_association_is_strong() -> None:
    a, b = GEO_BATCH.a[:WINDOW], GEO_BATCH.b[:WINDOW]
    favourites = GEO.favourites_at(0)
    in_favourites = np.any(favourites[a] == b[:, None], axis=1)
    assert abs(in_favourites.mean() - GEO.affinity) < 0.03
    uniform_share = 1 / GEO.n_tags
    top_shares = []
    for region in np.unique(a):
        tags = b[a == region]
        if len(tags) >= 500:
            top_shares.append(np.bincount(tags).max() / len(tags))
    assert len(top_shares) >= 10
    assert min(top_shares) > 500 * uniform_share


def test_geo_association_drifts_so_an_old_table_degrades() -> None:
    first, last = GEO.favourites_at(0), GEO.favourites_at(GEO.n_events - 1)
    assert np.mean(first != last) > 0.9
    changed_after_one_epoch = np.mean(first != GEO.favourites_at(WINDOW))
    assert abs(changed_after_one_epoch - GEO.drift_share) < 0.05

    def window(index: int) -> tuple[np.ndarray, np.ndarray]:
        sl = slice(index * WINDOW, (index + 1) * WINDOW)
        return GEO_BATCH.a[sl], GEO_BATCH.b[sl]

    offline = top_tags_per_region(*window(0), n=GEO.favourites_per_region)
    online = top_tags_per_region(*window(7), n=GEO.favourites_per_region)
    offline_next, offline_late = coverage(offline, *window(1)), coverage(offline, *window(8))
    online_late = coverage(online, *window(8))
    assert offline_next > 0.6
    assert offline_late < offline_next - 0.3
    assert online_late > offline_late + 0.3


def test_geo_flash_tag_dominates_its_regions_only_during_the_flash() -> None:
    flashes = GEO.flashes(0, GEO.n_events)
    assert len(flashes) == 4
    assert [f.start // 250_000 for f in flashes] == [0, 1, 2, 3]
    flash = flashes[1]
    assert flash.stop - flash.start == GEO.flash_duration
    positions = np.arange(GEO.n_events)
    in_regions = np.isin(GEO_BATCH.a, flash.regions)
    during = in_regions & (positions >= flash.start) & (positions < flash.stop)
    outside = in_regions & ((positions < flash.start - 50_000) | (positions >= flash.stop + 50_000))
    assert abs(np.mean(GEO_BATCH.b[during] == flash.tag) - GEO.flash_share) < 0.05
    assert np.mean(GEO_BATCH.b[outside] == flash.tag) < 0.01
    assert GEO.flashes(flash.start, flash.start + 1) == [flash]


def test_geo_stable_favourites_never_drift_and_the_rest_do() -> None:
    spec = GeoTagsWorkload(stable_favourites=3, drift_every=10, drift_share=0.5)
    first, late = spec.favourites_at(0), spec.favourites_at(10_000)
    np.testing.assert_array_equal(first[:, :3], late[:, :3])
    assert np.mean(first[:, 3:] != late[:, 3:]) > 0.95


def test_geo_without_flashes_or_drift_is_stationary() -> None:
    spec = GeoTagsWorkload(n_events=10, drift_share=0.0, flash_every=None)
    assert spec.flashes(0, 10**9) == []
    np.testing.assert_array_equal(spec.favourites_at(0), spec.favourites_at(10**9))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kind": "pairs", "locality": 1.5}, "less than or equal to 1"),
        ({"kind": "pairs", "locality": -0.1}, "greater than or equal to 0"),
        ({"kind": "pairs", "pad_max": 20_001}, "less than or equal to 20000"),
        ({"kind": "pairs", "pad_min": 10, "pad_max": 5}, "must not exceed pad_max"),
        ({"kind": "pairs", "n_keys": 0}, "greater than or equal to 1"),
        ({"kind": "zipf-evolving", "n_keys": 0}, "greater than or equal to 1"),
        ({"kind": "zipf-evolving", "shifts": [0.0]}, "strictly inside (0, 1)"),
        ({"kind": "zipf-evolving", "shifts": [1.0]}, "strictly inside (0, 1)"),
        ({"kind": "zipf-evolving", "shifts": [0.5, 0.3]}, "strictly increasing"),
        ({"kind": "zipf-evolving", "shifts": [0.5, 0.5]}, "strictly increasing"),
        ({"kind": "geo-tags", "flash_every": 10, "flash_duration": 20}, "must not exceed"),
        ({"kind": "geo-tags", "n_regions": 2, "flash_regions": 3}, "must not exceed n_regions"),
        ({"kind": "geo-tags", "stable_favourites": 21}, "must not exceed favourites_per_region"),
        ({"kind": "pairs", "n_key": 10}, "Extra inputs are not permitted"),
        ({"kind": "uniform"}, "does not match any of the expected tags"),
        ({"kind": "pairs", "seed": -1}, "greater than or equal to 0"),
    ],
)
def test_invalid_specs_raise_clear_validation_errors(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_workload(raw)


@pytest.mark.parametrize(
    "raw",
    [
        {"kind": "pairs", "n_keys": 2**63},
        {"kind": "pairs", "n_keys": 10**12},
        {"kind": "zipf-evolving", "n_keys": 10**12},
        {"kind": "geo-tags", "n_tags": 10**12},
        {"kind": "geo-tags", "n_regions": 10**12},
    ],
    ids=["pairs-2**63", "pairs-10**12", "zipf", "geo-tags", "geo-regions"],
)
def test_key_counts_past_their_bound_are_refused_before_any_event_is_drawn(
    raw: dict[str, Any],
) -> None:
    with pytest.raises(ValidationError, match="less than or equal to"):
        parse_workload(raw)


def test_the_key_bounds_cover_the_largest_benchmark_and_are_inclusive() -> None:
    bound = workloads.MAX_KEYS
    assert bound >= 10 * 1_000_000  # bench/sim_speed.py and bench/reproduce_fish.py: a million
    assert PairsWorkload(n_keys=bound).n_keys == bound
    assert ZipfEvolvingWorkload(n_keys=bound).n_keys == bound
    assert GeoTagsWorkload(n_tags=bound, n_regions=workloads.MAX_REGIONS).n_tags == bound
    with pytest.raises(ValidationError, match=f"less than or equal to {bound}"):
        PairsWorkload(n_keys=bound + 1)
    with pytest.raises(ValidationError, match=f"less than or equal to {workloads.MAX_REGIONS}"):
        GeoTagsWorkload(n_regions=workloads.MAX_REGIONS + 1)


def test_a_flash_period_of_zero_disables_flashes_like_none() -> None:
    spec = GeoTagsWorkload(n_events=1_000, flash_every=0)
    assert spec.flash_every is None and spec.flashes(0, 1_000) == []
    assert parse_workload({"kind": "geo-tags", "flash_every": 0}) == GeoTagsWorkload(
        flash_every=None
    )
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        GeoTagsWorkload(flash_every=-1)


def test_too_few_regions_for_the_default_flash_regions_says_it_is_the_default() -> None:
    with pytest.raises(ValidationError) as refused:
        GeoTagsWorkload(n_regions=2)
    message = str(refused.value)
    assert "flash_regions (3, the default) must not exceed n_regions (2)" in message
    assert "set flash_every to 0" in message
    with pytest.raises(ValidationError, match=r"flash_regions \(4\) must not exceed"):
        GeoTagsWorkload(n_regions=2, flash_regions=4)
    assert GeoTagsWorkload(n_regions=2, flash_every=0).flash_every is None


def test_parse_workload_round_trips_every_kind() -> None:
    for spec in SPECS:
        parsed = parse_workload(spec.model_dump())
        assert type(parsed) is type(spec) and parsed == spec
    assert isinstance(parse_workload({"kind": "geo-tags"}), GeoTagsWorkload)


def test_specs_are_frozen() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        SPECS[0].n_events = 5


def test_relabel_b_renames_field_two_and_keeps_the_pairing() -> None:
    plain = PairsWorkload(n_events=20_000, n_keys=200, locality=1.0, seed=4)
    relabelled = PairsWorkload(n_events=20_000, n_keys=200, locality=1.0, seed=4, relabel_b=True)
    a_plain, b_plain = plain.events(0, 20_000).a, plain.events(0, 20_000).b
    a_rel, b_rel = relabelled.events(0, 20_000).a, relabelled.events(0, 20_000).b
    assert (a_plain == a_rel).all() and (b_plain == a_plain).all()
    assert (b_rel != a_rel).mean() > 0.9
    mapping = dict(zip(a_rel.tolist(), b_rel.tolist(), strict=True))
    assert len(set(mapping.values())) == len(mapping)
    assert all(1 <= v <= 200 for v in mapping.values())
    again = PairsWorkload(n_events=20_000, n_keys=200, locality=1.0, seed=4, relabel_b=True)
    assert (again.events(5_000, 9_000).b == b_rel[5_000:9_000]).all()


def test_relabel_b_names_do_not_depend_on_the_seed() -> None:
    names = [
        dict(
            zip(
                *(
                    (batch := spec.events(0, 5_000)).a.tolist(),
                    batch.b.tolist(),
                ),
                strict=True,
            )
        )
        for spec in (
            PairsWorkload(n_events=5_000, n_keys=50, locality=1.0, seed=s, relabel_b=True)
            for s in (1, 2)
        )
    ]
    assert names[0] == names[1]


def test_pairs_default_stream_is_pinned() -> None:
    """The default (``relabel_b`` off) stream is the one benchmarks and tests were built on."""
    batch = PairsWorkload(n_events=6, n_keys=10, locality=0.5, pad_max=9, seed=1).events(0, 6)
    assert batch.a.tolist() == [6, 4, 4, 7, 7, 6]
    assert batch.b.tolist() == [6, 9, 4, 7, 7, 7]
    assert batch.pad.tolist() == [1, 2, 2, 2, 9, 0]


def test_expected_counts_count_field_two_under_its_relabelled_names() -> None:
    plain = PairsWorkload(n_events=4_000, n_keys=30, locality=0.7, seed=6)
    relabelled = plain.model_copy(update={"relabel_b": True})
    batch = relabelled.events(0, relabelled.n_events)
    names = {
        str(old): str(new)
        for old, new in zip(
            plain.events(0, plain.n_events).b.tolist(), batch.b.tolist(), strict=True
        )
    }
    assert sum(old != new for old, new in names.items()) > 20
    truth, before = expected_counts(relabelled), expected_counts(plain)
    assert truth[truth["stage"] == "A"].equals(before[before["stage"] == "A"])
    renamed = before[before["stage"] == "B"].assign(key=lambda f: f["key"].map(names))
    b_truth = truth[truth["stage"] == "B"]
    assert dict(zip(b_truth["key"], b_truth["count"], strict=True)) == dict(
        zip(renamed["key"], renamed["count"], strict=True)
    )
    assert sorted(b_truth["key"]) == sorted(str(b) for b in set(batch.b.tolist()))
