"""Tests of keyplane.algorithms.ring: SHA-1 placement, clockwise candidates, minimal remapping."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyplane.algorithms.baselines import hash_worker
from keyplane.algorithms.ring import (
    BUCKET_CACHE_SLOTS,
    BUCKETS,
    CandidatePlacement,
    ConsistentHashRing,
    ModuloPlacement,
    key_bucket,
    key_buckets,
    make_placement,
    node_bucket,
)

KEYS = np.random.default_rng(7).integers(-(2**62), 2**62, size=3000, dtype=np.int64)


def test_key_bucket_is_the_first_four_bytes_of_sha1_of_the_little_endian_id():
    expected = int.from_bytes(hashlib.sha1((258).to_bytes(8, "little")).digest()[:4], "big")
    assert key_bucket(258) == expected
    assert 0 <= key_bucket(-1) < BUCKETS
    assert node_bucket(3, 0) == int.from_bytes(hashlib.sha1(b"worker-3#0").digest()[:4], "big")


def test_candidates_are_distinct_start_at_the_owner_and_are_prefix_stable():
    ring = ConsistentHashRing.of_size(8, virtual_nodes=20)
    for key in KEYS[:200].tolist():
        full = ring.candidates(key, 8)
        assert sorted(full) == list(range(8))
        assert full[0] == ring.owner(key)
        for d in range(1, 8):
            assert ring.candidates(key, d) == full[:d]


def test_vectorised_owners_match_the_clockwise_walk():
    ring = ConsistentHashRing.of_size(5)
    owners = ring.owners(KEYS)
    assert owners.tolist() == [ring.candidates(k, 1)[0] for k in KEYS.tolist()]


def test_owner_is_the_first_virtual_node_clockwise_with_wraparound():
    ring = ConsistentHashRing([0, 1], virtual_nodes=1)
    p0, p1 = node_bucket(0, 0), node_bucket(1, 0)
    (low_worker, low), (high_worker, high) = sorted([(0, p0), (1, p1)], key=lambda wp: wp[1])
    for key in KEYS[:300].tolist():
        bucket = key_bucket(key)
        expected = high_worker if low < bucket <= high else low_worker
        assert ring.owner(key) == expected


def test_virtual_nodes_spread_keys_evenly():
    ring = ConsistentHashRing.of_size(16)
    keys = np.arange(200_000, dtype=np.int64)
    share = np.bincount(ring.owners(keys), minlength=16) / keys.size
    assert share.max() < 1.3 / 16
    assert share.min() > 0.7 / 16


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    vnodes=st.integers(min_value=1, max_value=30),
    newcomer=st.integers(min_value=12, max_value=1000),
)
def test_a_joining_worker_only_takes_keys_never_moves_others(n, vnodes, newcomer):
    ring = ConsistentHashRing.of_size(n, vnodes)
    before = ring.owners(KEYS)
    ring.add_worker(newcomer)
    after = ring.owners(KEYS)
    moved = before != after
    assert np.all(after[moved] == newcomer)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=12),
    vnodes=st.integers(min_value=1, max_value=30),
    data=st.data(),
)
def test_a_leaving_worker_only_hands_over_its_own_keys(n, vnodes, data):
    leaving = data.draw(st.integers(min_value=0, max_value=n - 1))
    ring = ConsistentHashRing.of_size(n, vnodes)
    before = ring.owners(KEYS)
    d = data.draw(st.integers(min_value=1, max_value=n - 1))
    old_candidates = {k: ring.candidates(k, d + 1) for k in KEYS[:50].tolist()}
    ring.remove_worker(leaving)
    after = ring.owners(KEYS)
    kept = before != leaving
    assert np.array_equal(after[kept], before[kept])
    assert np.all(after != leaving)
    for key, old in old_candidates.items():
        assert ring.candidates(key, d) == tuple(w for w in old if w != leaving)[:d]


def test_adding_a_seventeenth_worker_moves_about_a_seventeenth_of_keys():
    ring = ConsistentHashRing.of_size(16)
    keys = np.arange(50_000, dtype=np.int64)
    before = ring.owners(keys)
    ring.add_worker(16)
    moved = np.mean(before != ring.owners(keys))
    assert 0.5 / 17 < moved < 1.5 / 17


def test_invalid_operations_raise():
    ring = ConsistentHashRing.of_size(3)
    with pytest.raises(ValueError, match="d must be"):
        ring.candidates(1, 4)
    with pytest.raises(ValueError, match="already"):
        ring.add_worker(0)
    with pytest.raises(ValueError, match="not on the ring"):
        ring.remove_worker(9)
    with pytest.raises(ValueError, match="no workers"):
        ConsistentHashRing().owners(np.array([1]))
    with pytest.raises(ValueError, match="virtual_nodes"):
        ConsistentHashRing([0], virtual_nodes=0)


def test_vectorised_key_buckets_match_the_scalar_sha1():
    assert key_buckets(KEYS).tolist() == [key_bucket(k) for k in KEYS.tolist()]
    assert key_buckets(np.empty(0, dtype=np.int64)).size == 0


def test_bucket_cache_survives_colliding_slots():
    # ~38k keys in 2^18 slots: thousands of pairs share a slot and evict each other
    keys = np.arange(BUCKET_CACHE_SLOTS + 5000, dtype=np.int64)[::-7]
    ring = ConsistentHashRing.of_size(4, virtual_nodes=4)
    expected = key_buckets(keys)
    mixed = np.random.default_rng(1).permutation(np.concatenate([keys, keys[:5000]]))
    for _ in range(2):
        assert np.array_equal(ring.buckets(keys), expected)
        assert np.array_equal(ring.buckets(mixed), key_buckets(mixed))
    assert ring.bucket(int(keys[3])) == key_bucket(int(keys[3]))


def test_candidate_walks_are_cached_per_key_and_forgotten_when_the_ring_changes():
    ring = ConsistentHashRing.of_size(6, virtual_nodes=10)
    short, full = ring.candidates(99, 2), ring.candidates(99, 6)
    assert ring.candidates(99, 2) == short == full[:2]
    ring.add_worker(6)
    grown = ring.candidates(99, 7)
    assert sorted(grown) == list(range(7))
    assert tuple(w for w in grown if w != 6)[:6] == full


def test_modulo_placement_is_hash_mod_n_with_distinct_hashed_choices():
    n = 12
    placement = ModuloPlacement(n)
    assert isinstance(placement, CandidatePlacement)
    assert np.array_equal(placement.owners(KEYS), hash_worker(KEYS, n))
    for key in KEYS[:100].tolist():
        full = placement.candidates(key, n)
        assert sorted(full) == list(range(n))
        assert full[0] == int(hash_worker(np.array([key]), n)[0])
        seeded = [int(hash_worker(np.array([key]), n, seed=j)[0]) for j in range(6 * n)]
        distinct = list(dict.fromkeys(seeded))
        assert list(full[: len(distinct)]) == distinct[:n]
        for d in range(1, n):
            assert placement.candidates(key, d) == full[:d]
    with pytest.raises(ValueError, match="d must be"):
        placement.candidates(1, n + 1)


def test_modulo_placement_moves_almost_every_key_when_a_worker_joins():
    keys = np.arange(50_000, dtype=np.int64)
    moved = np.mean(ModuloPlacement(16).owners(keys) != ModuloPlacement(17).owners(keys))
    assert moved > 0.9


def test_make_placement_names_the_two_kinds():
    assert isinstance(make_placement("ring", 3), ConsistentHashRing)
    assert isinstance(make_placement("modulo", 3), ModuloPlacement)
    assert isinstance(make_placement("ring", 3), CandidatePlacement)
    with pytest.raises(ValueError, match="placement"):
        make_placement("rendezvous", 3)
    with pytest.raises(ValueError, match="n_workers"):
        ModuloPlacement(0)
