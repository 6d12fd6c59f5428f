"""Where FISH may put a key: a consistent-hash ring, or plain ``hash mod n`` (paper 001 §5).

Why: FISH gives each hot key a set of candidate workers and each cold key one
worker. With ``hash mod n`` almost every key changes worker when a worker
joins or leaves, so almost all keyed state would have to move. On a ring,
a key belongs to the first worker clockwise from its position, and a joining
or leaving worker only takes over or hands back the arcs next to its own
virtual nodes (001 §5, Figure 8). Virtual nodes (001 §5, "small-scale worker
deployment") even out the arc lengths when there are few workers.

Both placements implement :class:`CandidatePlacement`, so FISH can run
without consistent hashing: :class:`ModuloPlacement` is the "FISH w/o CH"
arm of 001 §6.5 (Fig. 17).

Hashing of the ring, fixed so every process agrees:

* a key (an int64 id) sits at bucket ``SHA-1(id as 8 bytes little-endian,
  two's complement)``, first 4 bytes read big-endian, in ``[0, 2^32)``: the
  2^32 bucket space and the SHA-1 of 001 §5;
* virtual node ``r`` of worker ``w`` sits at ``SHA-1(b"worker-{w}#{r}")``
  read the same way. Ties between positions are broken by worker id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from keyplane.algorithms.baselines import hash_worker, mix64

DEFAULT_VIRTUAL_NODES = 160
"""Virtual nodes per worker. 160 is libketama's choice (the consistent-hashing
scheme memcached clients use): with ``v`` nodes a worker's share of the ring
has a relative spread of about ``1/sqrt(v)``, so 160 keeps arcs within about
±8% of fair at a ring of only 160·n positions."""

BUCKETS = 2**32
"""Size of the hash space (001 §5 uses a 32-bit hash)."""

BUCKET_CACHE_SLOTS = 1 << 18
"""Slots of the direct-mapped cache of key buckets (4 MiB). Why a cache: SHA-1
costs a Python call per key, and a skewed stream repeats its
frequent keys constantly. Why direct-mapped: a lookup is then a few numpy
operations on the whole chunk, with no per-key Python work on a hit; a
colliding key only evicts one other key."""

CANDIDATE_CACHE_KEYS = 1 << 16
"""Keys whose clockwise walk is kept (least recently used evicted). At most
``1/θ`` keys are hot at once, far fewer than this."""

_SLOT_BITS = BUCKET_CACHE_SLOTS.bit_length() - 1
_SLOT_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def key_bucket(key: int) -> int:
    """Ring position of one int64 key."""
    digest = hashlib.sha1(int(key).to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest[:4], "big")


def key_buckets(keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Ring position of each int64 key, without a cache (one SHA-1 per key)."""
    arr = np.ascontiguousarray(np.asarray(keys, dtype="<i8").reshape(-1))
    raw = arr.tobytes()
    sha1 = hashlib.sha1
    digests = b"".join(sha1(raw[i : i + 8]).digest()[:4] for i in range(0, len(raw), 8))
    return np.frombuffer(digests, dtype=">u4").astype(np.int64)


def node_bucket(worker: int, replica: int) -> int:
    """Ring position of virtual node ``replica`` of ``worker``."""
    digest = hashlib.sha1(f"worker-{worker}#{replica}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@runtime_checkable
class CandidatePlacement(Protocol):
    """How FISH maps keys to workers: a cold key's one worker, a hot key's ``d`` (001 §5).

    ``candidates(key, d)`` must be ``d`` distinct workers whose first is
    ``owners([key])[0]``, and prefix-stable: the candidates for ``d`` are the
    first ``d`` of those for ``d + 1``, so growing a hot key's ``d`` only
    adds workers and splitting a key never moves its existing state.
    """

    @property
    def workers(self) -> tuple[int, ...]:
        """The workers, sorted."""
        ...

    def __len__(self) -> int: ...

    def owners(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """The single worker of each key (a cold key's worker)."""
        ...

    def candidates(self, key: int, d: int) -> tuple[int, ...]:
        """The first ``d`` candidate workers of a key."""
        ...


class _WalkCache:
    """Per-key candidate walks, least recently used evicted.

    Why per key and not per ``(key, d)``: a hot key's ``d`` grows with its
    frequency, and a longer walk answers every shorter request by its
    prefix, so one entry per key serves all ``d``.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._walks: dict[int, tuple[int, ...]] = {}

    def get(self, key: int, d: int) -> tuple[int, ...] | None:
        walk = self._walks.pop(key, None)
        if walk is None:
            return None
        self._walks[key] = walk
        return walk[:d] if len(walk) >= d else None

    def put(self, key: int, walk: tuple[int, ...]) -> None:
        walks = self._walks
        walks.pop(key, None)
        if len(walks) >= self._limit:
            del walks[next(iter(walks))]
        walks[key] = walk

    def clear(self) -> None:
        self._walks.clear()

    def __len__(self) -> int:
        return len(self._walks)


class ConsistentHashRing:
    """A ring of workers, each placed at ``virtual_nodes`` positions.

    ``candidates(key, d)`` walks clockwise from the key and returns the first
    ``d`` distinct workers met. The walk is a prefix walk, so a key's
    candidates for ``d`` are the first ``d`` of its candidates for ``d + 1``:
    growing a hot key's ``d`` only adds workers.

    Lookups are cached: key buckets in a direct-mapped table
    (:data:`BUCKET_CACHE_SLOTS`), so routing a chunk of cold keys is
    vectorised apart from one SHA-1 per cache miss; candidate walks per key
    in an LRU table (:data:`CANDIDATE_CACHE_KEYS`), dropped when the ring
    changes.
    """

    def __init__(
        self, workers: Iterable[int] = (), virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    ) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be positive, got {virtual_nodes}")
        self._virtual_nodes = virtual_nodes
        self._workers: set[int] = set()
        self._slot_keys = np.zeros(BUCKET_CACHE_SLOTS, dtype=np.int64)
        self._slot_buckets = np.full(BUCKET_CACHE_SLOTS, -1, dtype=np.int64)
        self._positions = np.empty(0, dtype=np.int64)
        self._owners = np.empty(0, dtype=np.int64)
        self._owner_list: list[int] = []
        self._walks = _WalkCache(CANDIDATE_CACHE_KEYS)
        for worker in workers:
            self._check_new(worker)
            self._workers.add(int(worker))
        self._rebuild()

    @classmethod
    def of_size(
        cls, n_workers: int, virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    ) -> ConsistentHashRing:
        """Ring over workers ``0 … n_workers - 1``."""
        if n_workers < 1:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        return cls(range(n_workers), virtual_nodes)

    @property
    def virtual_nodes(self) -> int:
        """Virtual nodes per worker."""
        return self._virtual_nodes

    @property
    def workers(self) -> tuple[int, ...]:
        """The workers on the ring, sorted."""
        return tuple(sorted(self._workers))

    def __len__(self) -> int:
        return len(self._workers)

    def _check_new(self, worker: int) -> None:
        if worker in self._workers:
            raise ValueError(f"worker {worker} is already on the ring")

    def _rebuild(self) -> None:
        nodes = [
            (node_bucket(w, r), w)
            for w in sorted(self._workers)
            for r in range(self._virtual_nodes)
        ]
        nodes.sort()
        self._positions = np.array([p for p, _ in nodes], dtype=np.int64)
        self._owner_list = [w for _, w in nodes]
        self._owners = np.array(self._owner_list, dtype=np.int64)
        self._walks.clear()

    def add_worker(self, worker: int) -> None:
        """Place a new worker; it takes over the arcs just before its virtual nodes."""
        self._check_new(worker)
        self._workers.add(int(worker))
        self._rebuild()

    def remove_worker(self, worker: int) -> None:
        """Remove a worker; its arcs go to the next worker clockwise."""
        if worker not in self._workers:
            raise ValueError(f"worker {worker} is not on the ring")
        self._workers.remove(worker)
        self._rebuild()

    def _require_workers(self) -> None:
        if not self._workers:
            raise ValueError("the ring has no workers")

    def bucket(self, key: int) -> int:
        """Ring position of one key."""
        return key_bucket(key)

    def buckets(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Ring position of each key; SHA-1 only for keys missing from the cache."""
        arr = np.asarray(keys, dtype=np.int64).reshape(-1)
        slots = ((arr.view(np.uint64) * _SLOT_MULTIPLIER) >> np.uint64(64 - _SLOT_BITS)).astype(
            np.intp
        )
        result = self._slot_buckets[slots]
        miss = (result < 0) | (self._slot_keys[slots] != arr)
        if miss.any():
            missing, inverse = np.unique(arr[miss], return_inverse=True)
            computed = key_buckets(missing)
            result[miss] = computed[inverse]
            fill = slots[miss]
            self._slot_keys[fill] = arr[miss]
            self._slot_buckets[fill] = result[miss]
        return result

    def owners(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """First worker clockwise of each key: a cold key's single worker."""
        self._require_workers()
        index = np.searchsorted(self._positions, self.buckets(keys), side="left")
        index[index == self._positions.size] = 0
        return self._owners[index]

    def owner(self, key: int) -> int:
        """First worker clockwise of one key."""
        return self.candidates(key, 1)[0]

    def candidates(self, key: int, d: int) -> tuple[int, ...]:
        """The first ``d`` distinct workers clockwise from the key (001 §5)."""
        self._require_workers()
        if not 1 <= d <= len(self._workers):
            raise ValueError(f"d must be in [1, {len(self._workers)}], got {d}")
        key = int(key)
        cached = self._walks.get(key, d)
        if cached is not None:
            return cached
        # Walk far enough for 2d distinct workers: a hot key's d grows over
        # time, and a longer walk answers later requests by its prefix.
        wanted = min(2 * d, len(self._workers))
        start = int(np.searchsorted(self._positions, key_bucket(key), side="left"))
        size = self._owners.size
        span = min(size, 4 * wanted)
        while True:
            arc = self._owner_list[start : start + span]
            if start + span > size:
                arc += self._owner_list[: start + span - size]
            walk = tuple(dict.fromkeys(arc))
            if len(walk) >= wanted or span == size:
                break
            span = min(size, 2 * span)
        self._walks.put(key, walk)
        return walk[:d]


class ModuloPlacement:
    """FISH without consistent hashing: ``hash mod n`` (the "w/o CH" arm of 001 §6.5).

    A key's single worker is :func:`keyplane.algorithms.baselines.hash_worker`, i.e.
    keyplane's own hash fallback and fields grouping, so this is exactly the
    mapping 001 §5 rejects: changing ``n`` remaps almost every key. A hot
    key's candidates are the distinct values of ``hash_worker(key, n, seed=j)``
    for ``j = 0, 1, …`` in order (D-Choices' hashed choices, deduplicated),
    which are as random as a ring walk, so the ablation changes only how keys
    are remapped, not how well a hot key's candidates spread. If ``16 n``
    seeds do not reach ``d`` distinct workers (probability about ``n·e^-16``
    when ``d = n``), the missing workers follow in increasing order.
    """

    def __init__(self, n_workers: int) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers must be positive, got {n_workers}")
        self._n = n_workers
        self._walks = _WalkCache(CANDIDATE_CACHE_KEYS)

    @property
    def workers(self) -> tuple[int, ...]:
        """Workers ``0 … n - 1``."""
        return tuple(range(self._n))

    def __len__(self) -> int:
        return self._n

    def owners(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """``hash_worker(key, n)`` of each key."""
        return hash_worker(np.asarray(keys, dtype=np.int64).reshape(-1), self._n)

    def candidates(self, key: int, d: int) -> tuple[int, ...]:
        """The first ``d`` distinct hashed choices of the key."""
        n = self._n
        if not 1 <= d <= n:
            raise ValueError(f"d must be in [1, {n}], got {d}")
        key = int(key)
        cached = self._walks.get(key, d)
        if cached is not None:
            return cached
        # hash_worker(key, n, seed=j) is splitmix64(key + (j + 1)γ) mod n (the
        # documented contract of keyplane.algorithms.baselines.mix64), so seeds 0 … m - 1
        # are seed 0 of key + jγ, computed in one vectorised call.
        shifted = np.uint64(key & 0xFFFFFFFFFFFFFFFF) + np.arange(
            16 * n, dtype=np.uint64
        ) * np.uint64(0x9E3779B97F4A7C15)
        choices = (mix64(shifted.view(np.int64)) % np.uint64(n)).astype(np.int64)
        _, first_seen = np.unique(choices, return_index=True)
        walk = choices[np.sort(first_seen)].tolist()
        taken = set(walk)
        walk += [w for w in range(n) if w not in taken]
        self._walks.put(key, tuple(walk))
        return tuple(walk[:d])


def make_placement(
    kind: str, n_workers: int, virtual_nodes: int = DEFAULT_VIRTUAL_NODES
) -> CandidatePlacement:
    """The placement named ``kind`` ("ring" or "modulo") over workers ``0 … n - 1``."""
    if kind == "ring":
        return ConsistentHashRing.of_size(n_workers, virtual_nodes)
    if kind == "modulo":
        return ModuloPlacement(n_workers)
    raise ValueError(f"candidate placement must be 'ring' or 'modulo', got {kind!r}")
