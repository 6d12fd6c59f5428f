"""Pair-statistics workloads and an independent locality count, shared by the
locality planner's tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from keyplane.algorithms.locality_plan import spark_workers
from keyplane.algorithms.pair_statistics import KeyWeights, PairStatistics


def correlated_window(
    seed: int, n_keys: int = 600, n_tuples: int = 30_000, noise: float = 0.1
) -> PairStatistics:
    """Tuples whose stage-B key is mostly one of three partners of the stage-A key.

    A key's partners come from its community of 30 keys, so the key graph has
    clear clusters. The partners are fixed (seed 0), so windows drawn with
    different seeds come from one distribution, like consecutive windows.
    """
    community = np.arange(n_keys) // 30
    offsets = np.random.default_rng(0).integers(0, 30, size=(n_keys, 3))
    partners = np.minimum(community[:, None] * 30 + offsets, n_keys - 1)
    rng = np.random.default_rng(seed)
    a_keys = np.minimum(rng.pareto(1.5, n_tuples) * 40, n_keys - 1).astype(np.int64)
    a_keys = np.random.default_rng(0).permutation(n_keys)[a_keys]
    b_keys = partners[a_keys, rng.integers(0, 3, n_tuples)]
    random = rng.random(n_tuples) < noise
    b_keys[random] = rng.integers(0, n_keys, int(random.sum()))
    return PairStatistics(a_keys, b_keys + 10_000, np.ones(n_tuples))


def brute_force_locality(
    pairs: PairStatistics,
    table_a: dict[int, int],
    table_b: dict[int, int],
    n: int,
    split: frozenset[int] = frozenset(),
) -> float:
    """Share of pair weight on one instance; a pair with a split key is local 1/n of the time."""
    local = 0.0
    for a, b, count in zip(pairs.a_keys.tolist(), pairs.b_keys.tolist(), pairs.counts, strict=True):
        if a in split or b in split:
            local += count / n
            continue
        worker_a = table_a.get(a, int(spark_workers(np.array([a]), n)[0]))
        worker_b = table_b.get(b, int(spark_workers(np.array([b]), n)[0]))
        local += count * (worker_a == worker_b)
    return local / float(pairs.counts.sum())


@st.composite
def skewed_graphs(draw: st.DrawFn) -> tuple[PairStatistics, int, float, int | None, int]:
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 8))
    alpha = draw(st.sampled_from([1.0, 1.01, 1.03, 1.1, 1.5]))
    budget = draw(st.one_of(st.none(), st.integers(0, 40)))
    n_a, n_b = draw(st.integers(1, 60)), draw(st.integers(1, 60))
    n_pairs = draw(st.integers(0, 300))
    exponent = draw(st.floats(1.05, 3.0))
    rng = np.random.default_rng(seed)
    a_keys = (rng.zipf(exponent, n_pairs) - 1) % n_a
    b_keys = (rng.zipf(exponent, n_pairs) - 1) % n_b + 1_000
    counts = np.floor(rng.pareto(1.2, n_pairs) * 10.0)
    freq_a = None
    if draw(st.booleans()):
        extra = np.arange(n_a + 5)
        freq_a = KeyWeights(extra, np.floor(rng.pareto(1.0, extra.size) * 5.0))
    pairs = PairStatistics(a_keys, b_keys, counts, freq_a=freq_a)
    return pairs, n, alpha, budget, seed
